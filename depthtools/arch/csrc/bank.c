/* AttnRes' depth bank (library "bank": bankops.DepthBank; issue 20, third library; figures in
   benchmarks/RESULTS.md, "Fourth pass"). A mix at sublayer l reads all l earlier sources: O(L^2) passes over
   [N,d] sources per step, which with torch ops were several kernels per mix (logits, softmax or logsumexp, exp,
   a weighted-sum loop of addcmul_, each a pass) and, in backward, batched matmuls of tiny per-token matrices plus
   their temporaries. These kernels work on tiles of BT tokens: a mix reads its logits (the stored key dots times
   1/rms), takes the softmax and forms the weighted sum with each source tile read once; a flush adds pending
   mixes' contributions to a range of sources' gradients (dL/dv, dL/d dots, dL/d inv_rms) with each source tile
   and gradient tile read once. Tokens are independent: tiles are split over torch's intra-op threads, results do
   not depend on the count. */
#include "generic.h"
#include "common.h"
#define BT 128

#define REAL float
#define SFX f32
#define EXP exp_f32
#include "bank_impl.h"
#include "undef_generic.h"

#define REAL double
#define SFX f64
#define EXP exp
#include "bank_impl.h"
#include "undef_generic.h"
