"""The hand-written kernels as torch custom ops (`torch.library.custom_op`, namespace `depthtools::`).

One module per kernel library (the C sources are in `depthtools/arch/csrc/`, built by `cpu_kernels`): each op
has a typed schema, a fake (meta) implementation so `torch.compile` and the `meta` device trace it without
running it, autograd registered once where the op is differentiable, and one implementation that runs the C
kernel on CPU float32/float64 when the library is built and, everywhere else, the same computation in torch ops:
the Sinkhorn's, the bank's and MoDA's plain-PyTorch twins; for the HC/mHC connectors the plain-autograd reference
itself (reference.py; their callers take the reference directly where the kernel does not apply, see
ops/connector.py). The kernels are called through `cpu_kernels.Kernel`: each module declares the C parameter
names it passes, checked against the C sources when the library loads. Eager code, compiled code and the meta
device all call these ops.
"""
