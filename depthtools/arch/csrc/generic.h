/* Type-generic kernels: a file *_impl.h is included once per scalar type, after defining
     REAL  the arithmetic type (float, double),
     SFX   the suffix of the functions it defines (f32, f64, bf16): FN(name) is name_SFX,
   and the math it calls (EXP, and SQRT / LOG / KV_T where the file uses them). undef_generic.h
   clears them before the next type. */
#define FN_PASTE_(name, sfx) name##_##sfx
#define FN_PASTE(name, sfx) FN_PASTE_(name, sfx)
#define FN(name) FN_PASTE(name, SFX)

/* The sources are also valid C++ (for a build through torch.utils.cpp_extension, which compiles as C++). */
#if defined(__cplusplus) && !defined(restrict)
#define restrict __restrict__
#endif
