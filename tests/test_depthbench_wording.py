"""What `depthbench --help` and the `causal --rule` refusal say DepthBench's skip rules are (issue 43):
Full and Block AttnRes take the `depthbench` rule under the protocol, not `next-output`."""

from __future__ import annotations

from typer.testing import CliRunner

from cli.main import app
from depthtools.analysis import depthbench as db

from tiny_models import tiny

runner = CliRunner()


def test_help_and_refusal_name_the_rules_the_protocol_uses():
    rules = {arch: db.skip_rule(tiny(arch, n_layer=2)) for arch in ("attnres", "blockattnres", "moda", "preln")}
    assert rules == {"attnres": "depthbench", "blockattnres": "depthbench", "moda": "zero", "preln": "identity"}
    shown = runner.invoke(app, ["depthbench", "--help"], terminal_width=200)
    assert shown.exit_code == 0 and "next-output" not in shown.stdout
    assert "AttnRes `depthbench`" in " ".join(shown.stdout.split())
    refused = runner.invoke(app, ["causal", "--ckpt", "x", "--protocol", "depthbench", "--rule", "mask"])
    assert refused.exit_code == 2 and "next-output" not in refused.stderr
    assert "AttnRes depthbench" in refused.stderr and "MoDA zero" in refused.stderr
