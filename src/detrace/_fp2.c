/* The `detrace-fp2` kernel on the CPU: the per-row lane sums of detrace.digest.scheme's fp2, compiled at install.

   For rows start <= r < stop of `width` 32-bit words (width <= 1024):
     SA[r] = sum over c of mixA(w[r, c] ^ TA[c] ^ RA[r])  (mod 2**32)
     SB[r] = sum over c of mixB(w[r, c] ^ TB[c] ^ RB[r])  (mod 2**32)
     out[r] = SA[r] | SB[r] << 32
   with rowkeys[r] = RA[r] | RB[r] << 32 and colkeys = TA[0..1023] then TB[0..1023]. Every operation is on 32-bit
   lanes (xor, logical shift, multiply, add), which vector units do natively: the compiler vectorizes the loop (AVX2
   or AVX-512 clones on x86-64 Linux, picked at load time; NEON on arm64 by default), and the plain C is the
   portable fallback. The same bits as the reference, eager and Triton kernels (tests/integration/test_digest.py). */

#include "_fpkernel.h"

static inline uint32_t mix_a(uint32_t x) {
    x ^= x >> 16;
    x *= UINT32_C(0x7FEB352D);
    x ^= x >> 15;
    x *= UINT32_C(0x846CA68B);
    x ^= x >> 16;
    return x;
}

static inline uint32_t mix_b(uint32_t x) { /* one round: a third multiply per word would cost a quarter */
    x ^= x >> 16;
    x *= UINT32_C(0x21F0AAAD);
    x ^= x >> 15;
    return x;
}

/* The loop must be vectorized whatever the build's -O level (at -O2 GCC before 12 does not vectorize it, and
   scalar code is several times slower than reading memory). */
#if defined(__GNUC__) && !defined(__clang__)
#define DETRACE_VECTORIZE __attribute__((optimize("O3")))
#else
#define DETRACE_VECTORIZE
#endif

DETRACE_CLONES("avx512f", "avx2", "default") DETRACE_VECTORIZE
static void sums(const unsigned char *words, Py_ssize_t width, const unsigned char *rowkeys,
                 const unsigned char *colkeys, unsigned char *out, Py_ssize_t start, Py_ssize_t stop) {
    const uint32_t *ta = (const uint32_t *)colkeys, *tb = ta + 1024; /* aligned: row_sums checks it */
    for (Py_ssize_t r = start; r < stop; r++) {
        const unsigned char *row = words + (size_t)r * (size_t)width * 4;
        uint64_t key;
        memcpy(&key, rowkeys + (size_t)r * 8, sizeof key);
        const uint32_t ka = (uint32_t)key, kb = (uint32_t)(key >> 32);
        uint32_t sa = 0, sb = 0;
        for (Py_ssize_t c = 0; c < width; c++) {
            uint32_t w; /* memcpy: a view of a tensor's bytes need not be 4-byte aligned */
            memcpy(&w, row + (size_t)c * 4, sizeof w);
            sa += mix_a(w ^ ta[c] ^ ka);
            sb += mix_b(w ^ tb[c] ^ kb);
        }
        const uint64_t both = (uint64_t)sa | (uint64_t)sb << 32;
        memcpy(out + (size_t)r * 8, &both, sizeof both);
    }
}

static const detrace_layout layout = {.word_bytes = 4, .max_width = 1024, .colkeys_bytes = 2048 * 4,
                                      .colkeys_align = 4};

DETRACE_MODULE(_fp2, sums, layout, DETRACE_AVX512F, "detrace-fp2's CPU kernel, compiled at install (see _fp2.c).")
