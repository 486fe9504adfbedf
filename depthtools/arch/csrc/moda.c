/* MoDA's depth attention (library "moda": moda._DepthAttention and _AppendSlots; issue 20, fourth library;
   figures in benchmarks/RESULTS.md, "Fifth pass"). The depth part of block l reads the same-position K/V of its
   S = 2l earlier slots: with torch ops a loop of hd multiply-adds per score and S per output, each a pass over
   [S, Hkv, N] scores or [Hkv, hd, N] outputs, ~1,700 small ops per forward; and a backward that added every
   reader's slot gradients into the buffers of all the slots it read (a read-modify-write of S slots per reader).
   These kernels read each slot's K and V rows once per tile of DT tokens (forward: scores, softmax joined with the
   sequence part's log-sum-exp, the weighted sum; backward: score gradients and the depth query's gradient) and
   form a slot's gradients once, when its writer's backward needs them, from the records its readers left
   (moda_slot_grads): O(readers) reads, one write.

   Slots are stored as the model's dtype (f32, f64) or, with option moda_kv_dtype="bfloat16", as bfloat16 bits
   (bf16: float32 arithmetic; a slot is rounded to nearest even once, when stored, as torch's
   .to(torch.bfloat16) rounds): moda_kv.h. */
#include "generic.h"
#include "common.h"
#define DT 1024
#define DTP (DT + 16)
#define ST 256
#define STP (ST + 16)
#include "moda_kv.h"

#define REAL float
#define KV_T float
#define SFX f32
#define EXP exp_f32
#define LOG logf
#include "moda_impl.h"
#include "undef_generic.h"

#define REAL double
#define KV_T double
#define SFX f64
#define EXP exp
#define LOG log
#include "moda_impl.h"
#include "undef_generic.h"

#define REAL float
#define KV_T unsigned short
#define SFX bf16
#define EXP exp_f32
#define LOG logf
#include "moda_impl.h"
#include "undef_generic.h"
