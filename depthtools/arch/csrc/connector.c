/* HC's and mHC's connectors as one C kernel per direction (library "connector"; issue 20, second library;
   figures in benchmarks/RESULTS.md, "Third pass"). At d = 64 a connector's cost is passes over the [N, n, d]
   stream state, which on CPU streams from memory; inductor's code for an HC block is 7 kernels forward and 9
   backward, most of them passing over it. These kernels make one: per token, the n rows' 1/rms and thin
   projection, the tanh coefficients and the mix [w; R] @ H (forward); the coefficient gradients, dL/dH and the
   parameter gradients (backward), all from that token's 1 KB of streams in L1. Rows of d are dot products and
   multiply-adds, which the compiler vectorises only if it may reassociate a sum (-fassociative-math: a fixed,
   compile-time order -- deterministic, not the index order of a plain loop) and contract multiply-adds; NaN and
   Inf still propagate (no -ffinite-math-only). Tokens are split over torch's intra-op threads (OpenMP);
   parameter gradients are summed per fixed chunk of tokens, so results do not depend on the thread count.

   mHC's connector (mhc_impl.h) is the same single pass, in blocks of BLK tokens so that the sigmoids and the
   Sinkhorn (sinkhorn_impl.h's block routines, compiled again here) run tokens-last and vectorised. */
#include "generic.h"
#include "common.h"
#define BLK 64

#define REAL float
#define SFX f32
#define SQRT sqrtf
#define EXP exp_f32
#include "sinkhorn_impl.h"
#include "connector_impl.h"
#include "mhc_impl.h"
#include "undef_generic.h"

#define REAL double
#define SFX f64
#define SQRT sqrt
#define EXP exp
#include "sinkhorn_impl.h"
#include "connector_impl.h"
#include "mhc_impl.h"
#include "undef_generic.h"
