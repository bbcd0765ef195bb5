/* Interleaved rANS for kvgate's weight compression: 64-bit states, 32-bit words, 12-bit probabilities.
 *
 * A chunk of n symbols is coded by LANES states in round robin (symbol i belongs to lane i % LANES) that share
 * one word stream, so the decoder's LANES dependency chains overlap in the CPU. The stream is LANES
 * little-endian u64 final states, then the u32 words in the order the decoder reads them. rans.py holds the
 * same algorithm in numpy and is the reference of the format: both must produce the same bytes.
 * Encoding and decoding release the GIL, so chunks are coded in parallel threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define SCALE_BITS 12
#define SCALE (1u << SCALE_BITS)
#define RANS_L (1ull << 31) /* states live in [RANS_L, 2^63) between symbols */
#define LANES 8
#define BLOCK 4096 /* symbols decoded before they are merged into the output */

enum { KIND_BYTES = 0, KIND_BF16 = 1, KIND_F16 = 2, KIND_F32 = 3 };

static const int REST_WIDTH[] = {0, 1, 1, 3};
static const int OUT_WIDTH[] = {1, 2, 2, 4};

/* freqs: 256 u32 summing to SCALE, each < SCALE. Each slot holds sym | (slot - start) << 8 | freq << 20. */
static int fill_table(const uint32_t *freqs, uint32_t *table) {
    uint32_t start = 0;
    for (uint32_t s = 0; s < 256; s++) {
        uint32_t f = freqs[s];
        if (f >= SCALE || start + f > SCALE) return -1;
        for (uint32_t k = 0; k < f; k++) table[start + k] = s | (k << 8) | (f << 20);
        start += f;
    }
    return start == SCALE ? 0 : -1;
}

static PyObject *py_decode_table(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer freqs;
    if (!PyArg_ParseTuple(args, "y*", &freqs)) return NULL;
    PyObject *out = NULL;
    if (freqs.len != 256 * 4) {
        PyErr_SetString(PyExc_ValueError, "freqs must be 256 uint32");
    } else if ((out = PyBytes_FromStringAndSize(NULL, SCALE * 4)) != NULL &&
               fill_table((const uint32_t *)freqs.buf, (uint32_t *)PyBytes_AS_STRING(out)) != 0) {
        Py_CLEAR(out);
        PyErr_SetString(PyExc_ValueError, "freqs must sum to 4096, each below 4096");
    }
    PyBuffer_Release(&freqs);
    return out;
}

/* encode(symbols: u8 buffer, freqs: 256 u32) -> bytes: one chunk's stream. */
static PyObject *py_encode(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer sym_buf, freq_buf;
    if (!PyArg_ParseTuple(args, "y*y*", &sym_buf, &freq_buf)) return NULL;
    PyObject *result = NULL;
    uint32_t *words = NULL;
    const uint8_t *sym = (const uint8_t *)sym_buf.buf;
    const uint32_t *freqs = (const uint32_t *)freq_buf.buf;
    Py_ssize_t n = sym_buf.len;
    /* Division by a symbol's frequency as a multiply by its reciprocal (ryg's rans64): x / f is
     * mulhi(x, rcp) >> shift for every x < 2^63, and the whole update is x + bias + q * (SCALE - f). */
    uint64_t rcp[256];
    uint32_t shift[256], bias[256], cmpl[256];
    uint32_t acc = 0;
    if (freq_buf.len != 256 * 4) {
        PyErr_SetString(PyExc_ValueError, "freqs must be 256 uint32");
        goto done;
    }
    for (int s = 0; s < 256; s++) {
        uint32_t f = freqs[s];
        cmpl[s] = SCALE - f;
        if (f < 2) {
            rcp[s] = ~0ull;
            shift[s] = 0;
            bias[s] = acc + SCALE - 1;
        } else {
            uint32_t sh = 0;
            while (f > (1u << sh)) sh++;
            uint64_t x0 = f - 1, x1 = 1ull << (sh + 31);
            uint64_t t1 = x1 / f;
            x0 += (x1 % f) << 32;
            uint64_t t0 = x0 / f;
            rcp[s] = t0 + (t1 << 32);
            shift[s] = sh - 1;
            bias[s] = acc;
        }
        acc += f;
    }
    if (acc != SCALE) {
        PyErr_SetString(PyExc_ValueError, "freqs must sum to 4096");
        goto done;
    }
    words = (uint32_t *)PyMem_RawMalloc((size_t)(n + 1) * 4); /* at most one word per symbol */
    if (!words) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t x[LANES];
    Py_ssize_t nwords = 0;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int l = 0; l < LANES; l++) x[l] = RANS_L;
    /* rANS is last in, first out: encode from the end, emitting words backwards, and reverse them below. */
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        uint32_t f = freqs[sym[i]];
        if (f == 0) {
            bad = 1;
            break;
        }
        uint64_t v = x[i % LANES];
        if (v >= (uint64_t)f << (63 - SCALE_BITS)) {
            words[nwords++] = (uint32_t)v;
            v >>= 32;
        }
        uint32_t s = sym[i];
        uint64_t q = (uint64_t)(((unsigned __int128)v * rcp[s]) >> 64) >> shift[s];
        x[i % LANES] = v + bias[s] + q * cmpl[s];
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "a symbol has frequency 0");
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, LANES * 8 + nwords * 4);
    if (!result) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    memcpy(out, x, LANES * 8); /* little-endian hosts only: checked when the module loads */
    uint8_t *w = out + LANES * 8;
    for (Py_ssize_t k = 0; k < nwords; k++) memcpy(w + 4 * k, &words[nwords - 1 - k], 4);
done:
    PyMem_RawFree(words);
    PyBuffer_Release(&sym_buf);
    PyBuffer_Release(&freq_buf);
    return result;
}

/* One lane's step. The renormalisation branch is taken for ~1 symbol in 12, so it predicts well enough. */
#define STEP(l)                                                                                          \
    do {                                                                                                 \
        uint32_t e = table[x##l & (SCALE - 1)];                                                          \
        syms[l] = (uint8_t)e;                                                                            \
        x##l = (uint64_t)(e >> 20) * (x##l >> SCALE_BITS) + ((e >> 8) & (SCALE - 1));                   \
        if (x##l < RANS_L) {                                                                             \
            uint32_t word;                                                                               \
            memcpy(&word, w, 4);                                                                         \
            x##l = (x##l << 32) | word;                                                                  \
            w += 4;                                                                                      \
        }                                                                                                \
    } while (0)

/* Element i of the output from its symbol and its raw rest bytes (the inverse of float_split.split). */
static inline void put(uint8_t *restrict out, const uint8_t *restrict rest, Py_ssize_t i, uint8_t s,
                       int kind) {
    switch (kind) {
    case KIND_BF16:
        ((uint16_t *)out)[i] = (uint16_t)(((rest[i] & 0x80) << 8) | (s << 7) | (rest[i] & 0x7f));
        break;
    case KIND_F16:
        ((uint16_t *)out)[i] = (uint16_t)((s << 8) | rest[i]);
        break;
    case KIND_F32: {
        const uint8_t *r = rest + 3 * i;
        ((uint32_t *)out)[i] = ((uint32_t)(r[0] & 0x80) << 24) | ((uint32_t)s << 23) |
                               ((uint32_t)(r[0] & 0x7f) << 16) | ((uint32_t)r[1] << 8) | r[2];
        break;
    }
    default:
        out[i] = s;
    }
}

/* kind is a constant at each call site in decode_core, so put()'s switch folds away. Returns 0, or -1 for a
 * stream too short for n symbols, -2 for one that does not end where its encoder began. */
static inline __attribute__((always_inline)) int decode_kind(const uint8_t *restrict stream, Py_ssize_t len,
                                                            const uint32_t *restrict table,
                                                            const uint8_t *restrict rest,
                                                            uint8_t *restrict out, Py_ssize_t n, int kind) {
    if (len < LANES * 8 || (len - LANES * 8) % 4) return -1;
    uint64_t xs[LANES];
    memcpy(xs, stream, LANES * 8);
    /* Named locals rather than an array, so that the compiler keeps every state in a register. */
    uint64_t x0 = xs[0], x1 = xs[1], x2 = xs[2], x3 = xs[3], x4 = xs[4], x5 = xs[5], x6 = xs[6], x7 = xs[7];
    const uint8_t *w = stream + LANES * 8, *wend = stream + len;
    uint8_t block[BLOCK];
    Py_ssize_t i = 0;
    /* Fast path: a block's symbols first (the lanes' chains overlap), then its output in one vectorisable
     * pass; it runs while a whole round's words (at most LANES) certainly lie inside the stream. */
    while (i + LANES <= n && wend - w >= 4 * LANES) {
        Py_ssize_t b = 0;
        for (; b < BLOCK && i + b + LANES <= n && wend - w >= 4 * LANES; b += LANES) {
            uint8_t *syms = block + b;
            STEP(0); STEP(1); STEP(2); STEP(3); STEP(4); STEP(5); STEP(6); STEP(7);
        }
        for (Py_ssize_t k = 0; k < b; k++) put(out, rest, i + k, block[k], kind);
        i += b;
    }
    xs[0] = x0, xs[1] = x1, xs[2] = x2, xs[3] = x3, xs[4] = x4, xs[5] = x5, xs[6] = x6, xs[7] = x7;
    /* Tail: the last rounds, with a bounds check on every read. */
    for (; i < n; i++) {
        int l = (int)(i % LANES);
        uint32_t e = table[xs[l] & (SCALE - 1)];
        uint64_t v = (uint64_t)(e >> 20) * (xs[l] >> SCALE_BITS) + ((e >> 8) & (SCALE - 1));
        if (v < RANS_L) {
            if (wend - w < 4) return -1;
            uint32_t word;
            memcpy(&word, w, 4);
            v = (v << 32) | word;
            w += 4;
        }
        xs[l] = v;
        put(out, rest, i, (uint8_t)e, kind);
    }
    /* A sound stream ends exactly where its encoder began: every state back at RANS_L, every word read. */
    if (w != wend) return -2;
    for (int l = 0; l < LANES; l++)
        if (xs[l] != RANS_L) return -2;
    return 0;
}

static int decode_core(const uint8_t *stream, Py_ssize_t len, const uint32_t *table, const uint8_t *rest,
                       uint8_t *out, Py_ssize_t n, int kind) {
    switch (kind) {
    case KIND_BF16: return decode_kind(stream, len, table, rest, out, n, KIND_BF16);
    case KIND_F16: return decode_kind(stream, len, table, rest, out, n, KIND_F16);
    case KIND_F32: return decode_kind(stream, len, table, rest, out, n, KIND_F32);
    default: return decode_kind(stream, len, table, rest, out, n, KIND_BYTES);
    }
}

/* decode(stream, table, rest, out, n, kind): fills the writable buffer out with n elements. */
static PyObject *py_decode(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer stream, table, rest, out;
    Py_ssize_t n;
    int kind;
    if (!PyArg_ParseTuple(args, "y*y*y*w*ni", &stream, &table, &rest, &out, &n, &kind)) return NULL;
    PyObject *result = NULL;
    if (kind < 0 || kind > KIND_F32 || n < 0 || table.len != SCALE * 4 || rest.len != n * REST_WIDTH[kind] ||
        out.len != n * OUT_WIDTH[kind]) {
        PyErr_SetString(PyExc_ValueError, "decode: the sizes of table, rest or out do not match n and kind");
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = decode_core((const uint8_t *)stream.buf, stream.len, (const uint32_t *)table.buf,
                     (const uint8_t *)rest.buf, (uint8_t *)out.buf, n, kind);
    Py_END_ALLOW_THREADS
    if (rc == -1)
        PyErr_SetString(PyExc_ValueError, "the rANS stream is too short for its symbol count");
    else if (rc == -2)
        PyErr_SetString(PyExc_ValueError, "the rANS stream does not end in its initial state");
    else
        result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&stream);
    PyBuffer_Release(&table);
    PyBuffer_Release(&rest);
    PyBuffer_Release(&out);
    return result;
}

/* split(raw, kind) -> (symbols, rest, counts): float_split.split and the symbols' histogram (256 u64) in one
 * pass over the tensor's bytes. */
static PyObject *py_split(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer raw;
    int kind;
    if (!PyArg_ParseTuple(args, "y*i", &raw, &kind)) return NULL;
    PyObject *symbols = NULL, *rest = NULL, *counts = NULL, *result = NULL;
    if (kind < KIND_BF16 || kind > KIND_F32 || raw.len % OUT_WIDTH[kind]) {
        PyErr_SetString(PyExc_ValueError, "split: unknown kind, or a size that is not a whole number of elements");
        goto done;
    }
    Py_ssize_t n = raw.len / OUT_WIDTH[kind];
    symbols = PyBytes_FromStringAndSize(NULL, n);
    rest = PyBytes_FromStringAndSize(NULL, n * REST_WIDTH[kind]);
    counts = PyBytes_FromStringAndSize(NULL, 256 * 8);
    if (!symbols || !rest || !counts) goto done;
    uint8_t *sym = (uint8_t *)PyBytes_AS_STRING(symbols), *r = (uint8_t *)PyBytes_AS_STRING(rest);
    uint64_t *hist = (uint64_t *)PyBytes_AS_STRING(counts);
    const uint8_t *in = (const uint8_t *)raw.buf;
    Py_BEGIN_ALLOW_THREADS
    memset(hist, 0, 256 * 8);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t s;
        if (kind == KIND_F32) {
            uint32_t u;
            memcpy(&u, in + 4 * i, 4);
            s = (uint8_t)(u >> 23);
            r[3 * i] = (uint8_t)(((u >> 24) & 0x80) | ((u >> 16) & 0x7f));
            r[3 * i + 1] = (uint8_t)(u >> 8);
            r[3 * i + 2] = (uint8_t)u;
        } else {
            uint16_t u;
            memcpy(&u, in + 2 * i, 2);
            if (kind == KIND_BF16) {
                s = (uint8_t)(u >> 7);
                r[i] = (uint8_t)(((u >> 8) & 0x80) | (u & 0x7f));
            } else {
                s = (uint8_t)(u >> 8);
                r[i] = (uint8_t)u;
            }
        }
        sym[i] = s;
        hist[s]++;
    }
    Py_END_ALLOW_THREADS
    result = PyTuple_Pack(3, symbols, rest, counts);
done:
    Py_XDECREF(symbols);
    Py_XDECREF(rest);
    Py_XDECREF(counts);
    PyBuffer_Release(&raw);
    return result;
}

/* expand_palette(codes, low, palette, exception_index, exception_value, out): palette.expand_reference in
 * one pass (BF16 bits = palette[4-bit code] | low byte, then the exceptions), GIL released. */
static PyObject *py_expand_palette(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer codes, low, palette, index, value, out;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*", &codes, &low, &palette, &index, &value, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = low.len, m = index.len / 4;
    if (codes.len != (n + 1) / 2 || palette.len != 32 || index.len % 4 || value.len != m * 2 ||
        out.len != n * 2) {
        PyErr_SetString(PyExc_ValueError, "expand_palette: the sizes of the parts do not match");
        goto done;
    }
    const uint8_t *c = (const uint8_t *)codes.buf, *lo = (const uint8_t *)low.buf;
    const int32_t *where = (const int32_t *)index.buf;
    const uint16_t *val = (const uint16_t *)value.buf;
    uint16_t pal[16], *o = (uint16_t *)out.buf;
    memcpy(pal, palette.buf, 32);
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    uint32_t pairs[256]; /* both elements of a code byte at once (little-endian: element 2j in the low half) */
    for (uint32_t b = 0; b < 256; b++) pairs[b] = pal[b & 15] | ((uint32_t)pal[b >> 4] << 16);
    for (Py_ssize_t j = 0; j < n / 2; j++) {
        uint32_t v = pairs[c[j]] | lo[2 * j] | ((uint32_t)lo[2 * j + 1] << 16);
        memcpy(o + 2 * j, &v, 4);
    }
    if (n & 1) o[n - 1] = (uint16_t)(pal[c[n >> 1] & 15] | lo[n - 1]);
    for (Py_ssize_t k = 0; k < m; k++) {
        if (where[k] < 0 || where[k] >= n) {
            bad = 1;
            break;
        }
        o[where[k]] = val[k];
    }
    Py_END_ALLOW_THREADS
    if (bad)
        PyErr_SetString(PyExc_ValueError, "expand_palette: an exception index lies outside the tensor");
    else
        result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&codes);
    PyBuffer_Release(&low);
    PyBuffer_Release(&palette);
    PyBuffer_Release(&index);
    PyBuffer_Release(&value);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS, "encode(symbols, freqs) -> bytes: one chunk's rANS stream"},
    {"decode", py_decode, METH_VARARGS, "decode(stream, table, rest, out, n, kind): fill out, GIL released"},
    {"split", py_split, METH_VARARGS, "split(raw, kind) -> (symbols, rest, counts): one pass, GIL released"},
    {"expand_palette", py_expand_palette, METH_VARARGS, "expand a palette-form BF16 weight, GIL released"},
    {"decode_table", py_decode_table, METH_VARARGS, "decode_table(freqs) -> bytes: 4096 packed u32 slots"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rans", "Interleaved rANS codec; rans.py is its reference.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rans(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "_rans supports little-endian hosts only");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "LANES", LANES) < 0 ||
              PyModule_AddIntConstant(m, "SCALE_BITS", SCALE_BITS) < 0)) {
        Py_CLEAR(m);
    }
    return m;
}
