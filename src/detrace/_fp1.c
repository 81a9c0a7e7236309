/* The `detrace-fp1` kernel on the CPU: the per-row sums of detrace.digest.kernels, compiled when detrace is installed.

   out[r] = sum over c of mix(words[r * width + c] ^ colkeys[c] ^ rowkeys[r])  (mod 2**64),  start <= r < stop,

   with mix the 64-bit finalizer of MurmurHash3 (shift 33, the two multipliers below). The same bits as the
   reference, eager and compiled kernels of detrace.digest (tests/integration/test_digest.py holds them to each other).
   Compiled ahead of time, it is there from the first call of a process: no JIT to load, no compile to wait
   for. It releases the GIL, so detrace.digest.native splits the rows over Python threads. */

#include "_fpkernel.h"

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= UINT64_C(0xFF51AFD7ED558CCD);
    x ^= x >> 33;
    x *= UINT64_C(0xC4CEB9FE1A85EC53);
    x ^= x >> 33;
    return x;
}

static inline uint64_t load(const unsigned char *at) {
    uint64_t word; /* memcpy: a view of a tensor's bytes need not be 8-byte aligned */
    memcpy(&word, at, sizeof word);
    return word;
}

/* The 64-bit multiplies are vectorized where AVX2 is there (emulated from 32-bit ones) and run natively with
   AVX-512 DQ (x86-64-v4): in cache that clone hashed 35 GiB/s per core against the avx2 one's 13.5 (AMD EPYC,
   GCC 12, -O3; 2026-12-05). GCC takes `arch=x86-64-v4` in target_clones from release 11; clang and older GCC
   get the other two. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define FP1_AVX512 DETRACE_X86_64_V4
DETRACE_CLONES("arch=x86-64-v4", "avx2", "default")
#else
#define FP1_AVX512 DETRACE_NO_AVX512
DETRACE_CLONES("avx2", "default")
#endif
static void sums(const unsigned char *words, Py_ssize_t width, const unsigned char *rowkeys,
                 const unsigned char *colkeys, unsigned char *out, Py_ssize_t start, Py_ssize_t stop) {
    for (Py_ssize_t r = start; r < stop; r++) {
        const unsigned char *row = words + (size_t)r * (size_t)width * 8;
        const uint64_t key = load(rowkeys + (size_t)r * 8);
        uint64_t acc = 0;
        for (Py_ssize_t c = 0; c < width; c++) {
            acc += mix(load(row + (size_t)c * 8) ^ load(colkeys + (size_t)c * 8) ^ key);
        }
        memcpy(out + (size_t)r * 8, &acc, sizeof acc);
    }
}

static const detrace_layout layout = {.word_bytes = 8, .max_width = PY_SSIZE_T_MAX / 8, .colkeys_bytes = 0,
                                      .colkeys_align = 1, .lanes32 = 0};

DETRACE_MODULE(_fp1, sums, layout, FP1_AVX512, "detrace-fp1's CPU kernel, compiled at install (see _fp1.c).")
