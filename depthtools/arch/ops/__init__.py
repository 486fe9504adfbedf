"""The hand-written kernels as torch custom ops (`torch.library.custom_op`, namespace `depthtools::`).

One module per kernel library (the C sources are in `depthtools/arch/csrc/`, built by `cpu_kernels`): each op
has a typed schema, a fake (meta) implementation so `torch.compile` and the `meta` device trace it without
running it, autograd registered once where the op is differentiable, and one implementation that runs the C
kernel on CPU float32/float64 when the library is built and its plain-PyTorch twin (the same computation in
torch ops) everywhere else. Eager code, compiled code and the meta device all call these ops.
"""
