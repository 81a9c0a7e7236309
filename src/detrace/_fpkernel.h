/* What the CPU fingerprint kernels of every scheme share (_fp1.c, _fp2.c): the Python entry points `row_sums` and
   `total` (argument parsing, the buffer checks, the loop run without the GIL, the buffers released on every path)
   and the module boilerplate. Each kernel file defines only its loop, `sums`, and names its module with DETRACE_MODULE. */

#ifndef DETRACE_FPKERNEL_H
#define DETRACE_FPKERNEL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <setjmp.h>
#include <signal.h>
#define DETRACE_BUS_GUARD 1
#else
#define DETRACE_BUS_GUARD 0
#endif

/* On x86-64 Linux under GCC/clang, clones of the loop for the listed targets beside the baseline one, picked at
   load time by the CPU it runs on: the compiler vectorizes a loop only for the instructions a target has. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define DETRACE_CLONES(...) __attribute__((target_clones(__VA_ARGS__)))
#else
#define DETRACE_CLONES(...)
#endif

/* out[r] for start <= r < stop: the per-row sum of rows of `width` words of `words`, keyed by rowkeys[r] (one
   uint64 per row) and the column keys. */
typedef void (*detrace_sums)(const unsigned char *words, Py_ssize_t width, const unsigned char *rowkeys,
                             const unsigned char *colkeys, unsigned char *out, Py_ssize_t start, Py_ssize_t stop);

/* The layout a kernel's buffers must have, checked before its loop runs on them. */
typedef struct {
    Py_ssize_t word_bytes;    /* bytes per word of `words` (8 for fp1, 4 for fp2) */
    Py_ssize_t max_width;     /* most words per row */
    Py_ssize_t colkeys_bytes; /* bytes of `colkeys` needed: 0 for word_bytes per column of the row width */
    Py_ssize_t colkeys_align; /* alignment of `colkeys` that the loop reads it with */
    int lanes32;              /* how row sums add up: lane by lane mod 2**32 (fp2), else mod 2**64 (fp1) */
} detrace_layout;

/* The definition's rows: 4096 bytes, the last one zero-padded (detrace.digest.scheme). */
#define DETRACE_ROW_BYTES 4096

/* Bus errors. `detrace verify-checkpoint` hashes a checkpoint where it lies in the mapped file: if another process
   truncates the file meanwhile, reading a page past its new end raises SIGBUS, which would kill the process with
   no sentence. While `catch_bus_errors(True)` is in force (until the matching `catch_bus_errors(False)`), a SIGBUS
   on a thread inside the loop of `row_sums` or `total` jumps back to it, which raises OSError(EFAULT) for detrace to
   say in one sentence. Any other SIGBUS puts back the handler there was before, which then takes it (the
   default: the process dies as it would have). The handler is installed for the verify only, not for the life of
   the process: frameworks reset every signal's handler (Lightning restores what `signal.getsignal` gave it, the
   default for a handler installed in C), and a handler of each module left in place would chain into the
   other's. */
#if DETRACE_BUS_GUARD
static _Thread_local sigjmp_buf *detrace_bus_guard; /* set while this thread's loop reads the buffers */
static struct sigaction detrace_bus_before;
static int detrace_bus_depth; /* catch_bus_errors(True) calls not yet ended, under the GIL */

static void detrace_on_bus(int sig, siginfo_t *info, void *context) {
    (void)context;
    sigjmp_buf *guard = detrace_bus_guard;
    if (guard != NULL) {
        detrace_bus_guard = NULL;
        siglongjmp(*guard, 1);
    }
    /* not a read of ours: the handler there was, from now on; a faulting access runs again and meets it */
    sigaction(sig, &detrace_bus_before, NULL);
    if (info == NULL || info->si_code <= 0) { /* sent (kill, raise), not a fault: it will not come again */
        raise(sig);
    }
}
#endif

/* catch_bus_errors(on): with True, install the SIGBUS handler (nested calls count); with False, end the matching
   call, putting back the handler there was when the outermost one ends. */
static PyObject *detrace_catch_bus_errors(PyObject *on) {
    const int want = PyObject_IsTrue(on);
    if (want < 0) {
        return NULL;
    }
#if DETRACE_BUS_GUARD
    if (want && detrace_bus_depth++ == 0) {
        struct sigaction action;
        memset(&action, 0, sizeof action);
        action.sa_sigaction = detrace_on_bus;
        /* SA_NODEFER: the jump out of the handler leaves SIGBUS unblocked for the thread's next fault */
        action.sa_flags = SA_SIGINFO | SA_NODEFER;
        sigemptyset(&action.sa_mask);
        if (sigaction(SIGBUS, &action, &detrace_bus_before) != 0) {
            detrace_bus_depth = 0;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    } else if (!want && detrace_bus_depth > 0 && --detrace_bus_depth == 0) {
        struct sigaction now;
        /* put back only over our own: another handler installed meanwhile stays */
        if (sigaction(SIGBUS, NULL, &now) == 0 && (now.sa_flags & SA_SIGINFO) && now.sa_sigaction == detrace_on_bus) {
            sigaction(SIGBUS, &detrace_bus_before, NULL);
        }
    }
#endif
    Py_RETURN_NONE;
}

/* sums(...) with a bus error on this thread's reads turned into a return of 0 (else 1). */
static int detrace_guarded_sums(detrace_sums sums, const unsigned char *words, Py_ssize_t width,
                                const unsigned char *rowkeys, const unsigned char *colkeys, unsigned char *out,
                                Py_ssize_t start, Py_ssize_t stop) {
#if DETRACE_BUS_GUARD
    sigjmp_buf guard;
    if (sigsetjmp(guard, 0) != 0) { /* 0: no signal mask saved (a system call per call); see SA_NODEFER */
        return 0;
    }
    detrace_bus_guard = &guard;
#endif
    sums(words, width, rowkeys, colkeys, out, start, stop);
#if DETRACE_BUS_GUARD
    detrace_bus_guard = NULL;
#endif
    return 1;
}

/* row_sums(words, width, rowkeys, colkeys, out, start, stop): checks the buffers against `layout`, runs `sums`
   without the GIL (so detrace.digest.native splits rows over Python threads), releases the buffers. */
static PyObject *detrace_row_sums(PyObject *args, detrace_sums sums, const detrace_layout *layout) {
    Py_buffer words, rowkeys, colkeys, out;
    Py_ssize_t width, start, stop;
    if (!PyArg_ParseTuple(args, "y*ny*y*w*nn", &words, &width, &rowkeys, &colkeys, &out, &start, &stop)) {
        return NULL;
    }
    const Py_ssize_t colkeys_bytes = layout->colkeys_bytes ? layout->colkeys_bytes : width * layout->word_bytes;
    const char *problem = NULL;
    if (width < 0 || width > layout->max_width || start < 0 || stop < start) {
        problem = "row_sums: width, start and stop must satisfy 0 <= width <= the row width and 0 <= start <= stop";
    } else if ((width > 0 && stop > words.len / layout->word_bytes / width) || rowkeys.len / 8 < stop ||
               out.len / 8 < stop || colkeys.len < colkeys_bytes ||
               ((uintptr_t)colkeys.buf % (uintptr_t)layout->colkeys_align) != 0) {
        problem = "row_sums: a buffer is shorter than width, start and stop require, or colkeys is misaligned";
    }
    int read = 1;
    if (problem == NULL) {
        Py_BEGIN_ALLOW_THREADS
        read = detrace_guarded_sums(sums, words.buf, width, rowkeys.buf, colkeys.buf, out.buf, start, stop);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&words);
    PyBuffer_Release(&rowkeys);
    PyBuffer_Release(&colkeys);
    PyBuffer_Release(&out);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    if (!read) {
        errno = EFAULT;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* The scheme's sum of two partial sums (detrace.digest.scheme.add). */
static uint64_t detrace_add(uint64_t a, uint64_t b, int lanes32) {
    if (!lanes32) {
        return a + b;
    }
    return ((a + b) & UINT64_C(0xFFFFFFFF)) | ((a >> 32) + (b >> 32)) << 32;
}

/* The scheme's sum of the row sums of rows start..stop of `data` (`len` bytes in rows of 4096, the last partial one
   zero-padded) into *sum, with a bus error on this thread's reads (the tail's copy too) turned into a return of 0
   (else 1), as detrace_guarded_sums. */
static int detrace_guarded_total(detrace_sums sums, const detrace_layout *layout, const unsigned char *data,
                                 Py_ssize_t len, const unsigned char *rowkeys, const unsigned char *colkeys,
                                 Py_ssize_t start, Py_ssize_t stop, uint64_t *sum) {
#if DETRACE_BUS_GUARD
    sigjmp_buf guard;
    if (sigsetjmp(guard, 0) != 0) {
        return 0;
    }
    detrace_bus_guard = &guard;
#endif
    const Py_ssize_t width = DETRACE_ROW_BYTES / layout->word_bytes, whole = len / DETRACE_ROW_BYTES;
    uint64_t out[256]; /* row sums of a block of rows, added up as the scheme adds them */
    unsigned char tail[DETRACE_ROW_BYTES];
    uint64_t total = 0;
    for (Py_ssize_t block = start; block < stop; block += 256) {
        const Py_ssize_t end = block + 256 < stop ? block + 256 : stop, full = end < whole ? end : whole;
        if (block < full) { /* whole rows, hashed where they lie */
            sums(data + block * DETRACE_ROW_BYTES, width, rowkeys + block * 8, colkeys, (unsigned char *)out, 0,
                 full - block);
        }
        if (full < end) { /* the last row, partial: zero-padded */
            memset(tail, 0, sizeof tail);
            memcpy(tail, data + full * DETRACE_ROW_BYTES, (size_t)(len - full * DETRACE_ROW_BYTES));
            sums(tail, width, rowkeys + full * 8, colkeys, (unsigned char *)&out[full - block], 0, 1);
        }
        for (Py_ssize_t r = 0; r < end - block; r++) {
            total = detrace_add(total, out[r], layout->lanes32);
        }
    }
#if DETRACE_BUS_GUARD
    detrace_bus_guard = NULL;
#endif
    *sum = total;
    return 1;
}

/* total(data, rowkeys, colkeys, start, stop): the scheme's sum of the row sums of rows start..stop of the bytes
   `data` cut into rows of 4096 (any length and alignment; the last partial row zero-padded, as the definition
   pads it), row r keyed by rowkeys[r]. One call does what row_sums, a copy of the tail row and a sum in NumPy did
   (a fingerprint of one tensor, a piece of a checkpoint), without the GIL; OSError(EFAULT) where a read raised
   SIGBUS under catch_bus_errors(True). */
static PyObject *detrace_total_of(detrace_sums sums, const detrace_layout *layout, const unsigned char *data,
                                  Py_ssize_t len, const Py_buffer *rowkeys, const Py_buffer *colkeys,
                                  Py_ssize_t start, Py_ssize_t stop) {
    const Py_ssize_t colkeys_bytes = layout->colkeys_bytes ? layout->colkeys_bytes : DETRACE_ROW_BYTES;
    const Py_ssize_t whole = len / DETRACE_ROW_BYTES, rows = whole + (len % DETRACE_ROW_BYTES != 0);
    if (start < 0 || stop < start || stop > rows || rowkeys->len / 8 < stop || colkeys->len < colkeys_bytes ||
        ((uintptr_t)colkeys->buf % (uintptr_t)layout->colkeys_align) != 0) {
        PyErr_SetString(PyExc_ValueError,
                        "total: start and stop must satisfy 0 <= start <= stop <= the rows of data, rowkeys hold stop "
                        "keys, and colkeys must be whole and aligned");
        return NULL;
    }
    uint64_t sum = 0;
    int read;
    Py_BEGIN_ALLOW_THREADS
    read = detrace_guarded_total(sums, layout, data, len, rowkeys->buf, colkeys->buf, start, stop, &sum);
    Py_END_ALLOW_THREADS
    if (!read) {
        errno = EFAULT;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(sum);
}

static PyObject *detrace_total(PyObject *args, detrace_sums sums, const detrace_layout *layout) {
    Py_buffer data, rowkeys, colkeys;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "y*y*y*nn", &data, &rowkeys, &colkeys, &start, &stop)) {
        return NULL;
    }
    PyObject *result = detrace_total_of(sums, layout, data.buf, data.len, &rowkeys, &colkeys, start, stop);
    PyBuffer_Release(&data);
    PyBuffer_Release(&rowkeys);
    PyBuffer_Release(&colkeys);
    return result;
}

/* total_at(address, nbytes, rowkeys, colkeys, start, stop): total of the `nbytes` bytes at `address` (a tensor's
   data_ptr()). It spares the one-tensor path a uint8 view and a NumPy array per call (a few microseconds of a 1 MiB
   fingerprint); the caller keeps the memory alive and readable for the call. */
static PyObject *detrace_total_at(PyObject *args, detrace_sums sums, const detrace_layout *layout) {
    unsigned long long address;
    Py_buffer rowkeys, colkeys;
    Py_ssize_t nbytes, start, stop;
    if (!PyArg_ParseTuple(args, "Kny*y*nn", &address, &nbytes, &rowkeys, &colkeys, &start, &stop)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (nbytes < 0 || (address == 0 && nbytes > 0)) {
        PyErr_SetString(PyExc_ValueError, "total_at: nbytes must be >= 0 and the address not null");
    } else {
        result = detrace_total_of(sums, layout, (const unsigned char *)(uintptr_t)address, nbytes, &rowkeys,
                                  &colkeys, start, stop);
    }
    PyBuffer_Release(&rowkeys);
    PyBuffer_Release(&colkeys);
    return result;
}

/* The AVX-512 clone a kernel has beside avx2 and default (DETRACE_MODULE's AVX512): none, `avx512f`, or
   `arch=x86-64-v4` (AVX-512 F, BW, CD, DQ and VL: fp1 needs DQ's 64-bit multiplies). */
#define DETRACE_NO_AVX512 0
#define DETRACE_AVX512F 1
#define DETRACE_X86_64_V4 2

/* Which clone of the loop runs on this CPU: target_clones' resolver picks, at load time, the first of a kernel's
   targets that the CPU supports, the AVX-512 one (`avx512`) first, then avx2, then default. Elsewhere the one
   loop the build's target gives. `detrace doctor` reports it. */
static const char *detrace_vector_path(int avx512) {
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
    __builtin_cpu_init();
    if (avx512 == DETRACE_X86_64_V4 && __builtin_cpu_supports("x86-64-v4")) {
        return "x86-64-v4 (AVX-512)";
    }
    if (avx512 == DETRACE_AVX512F && __builtin_cpu_supports("avx512f")) {
        return "avx512f";
    }
    return __builtin_cpu_supports("avx2") ? "avx2" : "x86-64 baseline";
#elif defined(__aarch64__)
    (void)avx512;
    return "arm64 baseline (NEON)";
#else
    (void)avx512;
    return "the build's baseline target";
#endif
}

#if defined(__clang__)
#define DETRACE_COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#define DETRACE_COMPILER "gcc " __VERSION__
#else
#define DETRACE_COMPILER "an unknown compiler"
#endif

/* The module `detrace.NAME` with row_sums and total, running SUMS on buffers of layout LAYOUT, catch_bus_errors,
   and two
   strings for `detrace doctor`: VECTOR_PATH (the loop's clone on this CPU; AVX512: its AVX-512 clone, above) and
   COMPILER (what built it). */
#define DETRACE_MODULE(NAME, SUMS, LAYOUT, AVX512, DOC)                                                            \
    static PyObject *row_sums(PyObject *self, PyObject *args) {                                                    \
        (void)self;                                                                                                \
        return detrace_row_sums(args, SUMS, &(LAYOUT));                                                            \
    }                                                                                                              \
    static PyObject *catch_bus_errors(PyObject *self, PyObject *on) {                                              \
        (void)self;                                                                                                \
        return detrace_catch_bus_errors(on);                                                                       \
    }                                                                                                              \
    static PyObject *total(PyObject *self, PyObject *args) {                                                       \
        (void)self;                                                                                                \
        return detrace_total(args, SUMS, &(LAYOUT));                                                               \
    }                                                                                                              \
    static PyObject *total_at(PyObject *self, PyObject *args) {                                                    \
        (void)self;                                                                                                \
        return detrace_total_at(args, SUMS, &(LAYOUT));                                                            \
    }                                                                                                              \
    static PyMethodDef methods[] = {                                                                               \
        {"row_sums", row_sums, METH_VARARGS,                                                                       \
         "row_sums(words, width, rowkeys, colkeys, out, start, stop): the per-row sums of rows start..stop of "    \
         "words (C-contiguous rows of `width` words) into out (uint64), without the GIL; OSError(EFAULT) if "      \
         "reading words raised SIGBUS (a mapped file that shrank) under catch_bus_errors(True)."},                  \
        {"total", total, METH_VARARGS,                                                                             \
         "total(data, rowkeys, colkeys, start, stop): the sum of the row sums of rows start..stop of the bytes "   \
         "data in rows of 4096, the last zero-padded, without the GIL; OSError(EFAULT) as row_sums."},             \
        {"total_at", total_at, METH_VARARGS,                                                                       \
         "total_at(address, nbytes, rowkeys, colkeys, start, stop): total of the nbytes bytes at address, which "   \
         "the caller keeps alive and readable for the call."},                                                     \
        {"catch_bus_errors", catch_bus_errors, METH_O,                                                             \
         "catch_bus_errors(on): from catch_bus_errors(True) to the matching catch_bus_errors(False), a SIGBUS "    \
         "inside row_sums's or total's loop makes it raise OSError(EFAULT)."},                                                                                       \
        {NULL, NULL, 0, NULL},                                                                                     \
    };                                                                                                             \
    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, #NAME, DOC, -1, methods, NULL, NULL, NULL, NULL};  \
    PyMODINIT_FUNC PyInit_##NAME(void) {                                                                          \
        PyObject *created = PyModule_Create(&module);                                                              \
        if (created != NULL &&                                                                                     \
            (PyModule_AddStringConstant(created, "VECTOR_PATH", detrace_vector_path(AVX512)) < 0 ||                \
             PyModule_AddStringConstant(created, "COMPILER", DETRACE_COMPILER) < 0)) {                             \
            Py_DECREF(created);                                                                                    \
            return NULL;                                                                                           \
        }                                                                                                          \
        return created;                                                                                            \
    }

#endif
