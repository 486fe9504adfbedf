"""Errors that users can cause and fix: one line, naming the bad thing and what would be valid."""


class DepthToolsError(ValueError):
    """A user-facing error (bad input, missing or corrupt file). The CLI prints it on one line, exit 2."""


class CheckpointError(DepthToolsError):
    """A checkpoint is missing, ambiguous, corrupt or does not match its config."""
