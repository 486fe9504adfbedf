/* mHC's Sinkhorn on CPU (library "sinkhorn": the op depthtools::sinkhorn_tokens_last, depthtools/arch/ops/sinkhorn.py).

   Why (issue 20; figures in benchmarks/RESULTS.md, "Compiled training (issue 20)"): the Sinkhorn of n = 4 streams
   is 2 t_max - 1 = 39 alternating half-steps over [4, 4, N] logits. With torch ops each half-step is three
   dispatches of tiny kernels (~15k per training step at L32), and inductor does no better. Here each token's
   n x n matrix is iterated in L1 (tokens in blocks of 64, the vectorised inner loop), forward and backward (the
   backward recomputes the iterates per block, so nothing is saved between them).

   The same iteration as sinkhorn_torch.sinkhorn_forward / sinkhorn_backward (softmax over dim `first`, then half-steps
   m * 1/max(sum m, tiny), sums in index order); it multiplies by reciprocals where the torch kernel divides, so
   results differ by an ulp or so per half-step. Built without -ffast-math and with -ffp-contract=off
   (cpu_kernels.py). tests/test_compile.py compares it with the reference in float64 and float32. */
#include "generic.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#define BLK 64

#define REAL float
#define SFX f32
#define EXP expf
#include "sinkhorn_impl.h"
#include "undef_generic.h"

#define REAL double
#define SFX f64
#define EXP exp
#include "sinkhorn_impl.h"
#include "undef_generic.h"
