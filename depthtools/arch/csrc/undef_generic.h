/* Clears one type's definitions (generic.h) before the next type is included. */
#undef REAL
#undef SFX
#undef EXP
#undef SQRT
#undef LOG
#undef KV_T
