/* Byte-plane kernels for the bytegroup codec, run with the GIL released.
 *
 * Why native: coding a chunk in numpy takes ~30 short calls (shifts, casts,
 * sample slices), and each one drops and retakes the GIL. With two coding
 * threads every retake can wait on the other thread, so a second thread
 * adds little instead of doubling throughput. Here each step is one call
 * that releases the GIL for its whole loop. bytegroup.py keeps a numpy
 * version of split, join and the plane judge, with the same results byte
 * for byte, for installs built without a C compiler.
 *
 * encode() does a float chunk's whole coding in one call: judge, split, and
 * zstd on the planes that pay (or on a split plane's low bits, split_plane
 * below), writing the payload bytegroup.py describes:
 * the same plane choices as the Python path, in other (equally valid) zstd
 * frames: PLANE_FAST below.
 * It calls libzstd's stable API, found at import with dlopen (python-zstandard
 * links its copy statically and exports nothing). Without a libzstd,
 * HAS_ZSTD is False and bytegroup.py calls zstd through python-zstandard,
 * with one GIL release per plane: with two coding threads on small chunks,
 * the one call codes fp32 and bf16 much faster (it never waits for the GIL).
 *
 * Values are little-endian words of `width` bytes (1, 2, 4 or 8). Each word
 * is rotated left by `rotate` bits, and byte p of the rotated word goes to
 * plane p. The rotation is recorded in the frame header (format/frames.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef _WIN32
#include <dlfcn.h>
#include <pthread.h>
#define HAVE_DLOPEN 1
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "planes are little-endian; big-endian hosts use the numpy fallback"
#endif

/* Sample layout, same as bytegroup.py's numpy fallback: chunks of at least
 * 4 * sample values are sampled in SLICES slices spread over the chunk;
 * smaller chunks are counted whole. */
#define SLICES 8

static int check_layout(int width, int rotate) {
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_Format(PyExc_ValueError, "width must be 1, 2, 4 or 8, not %d", width);
        return -1;
    }
    if (rotate < 0 || rotate >= 8 * width) {
        PyErr_Format(PyExc_ValueError, "rotate must be in [0, %d), not %d", 8 * width, rotate);
        return -1;
    }
    return 0;
}

/* One loop per width so the compiler sees a fixed word size. */
#define SPLIT_LOOP(T, W)                                                       \
    for (Py_ssize_t i = 0; i < n; i++) {                                       \
        T v;                                                                   \
        memcpy(&v, src + i * W, W);                                            \
        if (r) v = (T)((T)(v << r) | (T)(v >> (8 * W - r)));                   \
        for (int p = 0; p < W; p++) dst[p * n + i] = (uint8_t)(v >> (8 * p));  \
    }

static void split_words(const uint8_t *restrict src, uint8_t *restrict dst, Py_ssize_t n,
                        int width, int r) {
    switch (width) {
    case 1: memcpy(dst, src, (size_t)n); break;
    case 2: SPLIT_LOOP(uint16_t, 2) break;
    case 4: SPLIT_LOOP(uint32_t, 4) break;
    default: SPLIT_LOOP(uint64_t, 8) break;
    }
}

/* Estimated entropy-coded size, in bits, of `total` symbols counted in `hist`. */
static double entropy_bits(const uint32_t *hist, int symbols, double total) {
    double bits = total * log2(total);
    for (int b = 0; b < symbols; b++)
        if (hist[b]) bits -= hist[b] * log2((double)hist[b]);
    return bits;
}

/* Counts into four interleaved tables (value i into table i % 4): exponent
 * planes repeat a few byte values, and incrementing one counter back to back
 * waits on its previous store; four tables let the counts of neighbouring
 * values run in parallel, several times faster. */
#define COUNT_LOOP(T, W)                                                       \
    for (Py_ssize_t i = 0; i < count; i++) {                                   \
        T v;                                                                   \
        memcpy(&v, src + i * W, W);                                            \
        if (r) v = (T)((T)(v << r) | (T)(v >> (8 * W - r)));                   \
        uint32_t(*h)[256] = hist[i & 3];                                       \
        for (int b = 0; b < W; b++) h[b][(uint8_t)(v >> (8 * b))]++;           \
    }

static void count_bytes(const uint8_t *src, Py_ssize_t count, int width, int r,
                        uint32_t (*hist)[8][256]) {
    switch (width) {
    case 2: COUNT_LOOP(uint16_t, 2) break;
    case 4: COUNT_LOOP(uint32_t, 4) break;
    case 8: COUNT_LOOP(uint64_t, 8) break;
    default: COUNT_LOOP(uint8_t, 1) break;
    }
}

/* The cheapest method (split 2, then split 3, then zstd: the low streams are
 * 1/4 and 1/2 of the plane) whose estimate is within 1/SPLIT_SLACK byte per
 * value of the smallest is chosen: a sample's byte entropy underestimates by
 * up to ~0.01 bit per value (255 symbols seen in 16k values), a split's raw
 * bits are exact, and zstd's Huffman codes land above the entropy anyway. */
#define SPLIT_SLACK 256.0

/* Estimated Huffman-coded size, in bits, of `total` symbols counted in `hist`:
 * a symbol costs -log2 of its frequency but never under one bit (zstd codes
 * literals with Huffman codes, at least one bit each). On a plane whose zero
 * byte is over half the bytes, that floor is most of zstd's cost: the zeros
 * alone take a bit each, where their entropy is a fraction of one. */
static double floored_bits(const uint32_t *hist, int symbols, double total) {
    double bits = 0, whole = log2(total);
    for (int b = 0; b < symbols; b++) {
        if (!hist[b]) continue;
        double len = whole - log2((double)hist[b]);
        bits += hist[b] * (len > 1 ? len : 1);
    }
    return bits;
}

/* Counts, for plane p of `count` values, the byte each group of 8 values
 * adds to a sparse plane's bitmap (bit j set where value j's byte is not 0;
 * a last short group's missing values count as zeros). */
#define GROUP_LOOP(T, W)                                                       \
    for (Py_ssize_t i = 0; i < count; i++) {                                   \
        T v;                                                                   \
        memcpy(&v, src + i * W, W);                                            \
        if (r) v = (T)((T)(v << r) | (T)(v >> (8 * W - r)));                   \
        bits |= (unsigned)((uint8_t)(v >> (8 * p)) != 0) << (i & 7);           \
        if ((i & 7) == 7) ghist[bits]++, bits = 0;                             \
    }

static Py_ssize_t count_groups(const uint8_t *src, Py_ssize_t count, int width, int r, int p,
                               uint32_t *ghist) {
    unsigned bits = 0;
    switch (width) {
    case 2: GROUP_LOOP(uint16_t, 2) break;
    case 4: GROUP_LOOP(uint32_t, 4) break;
    case 8: GROUP_LOOP(uint64_t, 8) break;
    default: GROUP_LOOP(uint8_t, 1) break;
    }
    if (count & 7) ghist[bits]++;
    return (count + 7) / 8;
}

/* Whether a plane whose sampled bytes counted `hist` (zero bytes over 3/4,
 * not all) is smaller sparse (method 4) than zstd-coded: both estimated as
 * Huffman codes with their one-bit floor, the sparse plane as its bitmap's
 * bytes (counted on the sample by count_groups) plus its non-zero bytes. */
static int sparse_pays(const uint8_t *src, Py_ssize_t n, int width, int rotate, Py_ssize_t sample,
                       int p, const uint32_t *hist, double total) {
    uint32_t ghist[256];
    double groups = 0;
    memset(ghist, 0, sizeof ghist);
    if (n < 4 * sample) {
        groups = (double)count_groups(src, n, width, rotate, p, ghist);
    } else {
        Py_ssize_t step = n / SLICES, size = sample / SLICES;
        for (int k = 0; k < SLICES; k++)
            groups += (double)count_groups(src + k * step * width, size, width, rotate, p, ghist);
    }
    double sparse = floored_bits(ghist, 256, groups) + floored_bits(hist + 1, 255, total - hist[0]);
    return sparse < floored_bits(hist, 256, total);
}

/* The method of each plane, in nibble p of the result (a "plan"): 0 stores
 * the plane raw, 1 codes it with zstd, 2 and 3 split it (split_plane), 4
 * stores it sparse (sparse_plane; only instead of 1, see sparse_pays). Judged
 * on the sampled byte entropy, the plane's estimated coded size in bytes:
 * zstd finds almost no matches in float planes and codes them close to that.
 * A split costs its raw high bits plus the entropy of its low bits, and far
 * less time than zstd on the whole plane, so it wins near-ties (SPLIT_SLACK).
 * A plane is coded at all only if its best estimate saves `saving`. */
static unsigned long judge(const uint8_t *src, Py_ssize_t n, int width, int rotate,
                           Py_ssize_t sample, double saving) {
    uint32_t hist[4][8][256];
    unsigned long plan = 0;
    Py_ssize_t counted;
    memset(hist, 0, sizeof hist);
    if (n < 4 * sample) {
        count_bytes(src, n, width, rotate, hist);
        counted = n;
    } else {
        Py_ssize_t step = n / SLICES, size = sample / SLICES;
        for (int k = 0; k < SLICES; k++)
            count_bytes(src + k * step * width, size, width, rotate, hist);
        counted = size * SLICES;
    }
    for (int p = 0; p < width && counted; p++) {
        uint32_t low2[4] = {0}, low3[8] = {0};
        double total = (double)counted;
        for (int b = 0; b < 256; b++) {
            uint32_t c = hist[0][p][b] + hist[1][p][b] + hist[2][p][b] + hist[3][p][b];
            hist[0][p][b] = c;
            low2[b & 3] += c;
            low3[b & 7] += c;
        }
        double coded = entropy_bits(hist[0][p], 256, total) / 8;
        double split2 = total * 6.0 / 8.0 + entropy_bits(low2, 4, total) / 8;
        double split3 = total * 5.0 / 8.0 + entropy_bits(low3, 8, total) / 8;
        double least = coded < split2 ? coded : split2;
        least = split3 < least ? split3 : least;
        double near = least + total / SPLIT_SLACK;
        unsigned long method = split2 <= near ? 2 : split3 <= near ? 3 : 1;
        /* Only planes of mostly zeros (in XOR deltas, bytes that did not
         * change) can be sparse; where none is, as in checkpoints of floats,
         * the plan is what it was before method 4. Over 3/4 zeros: below
         * that, join_sparse's step per set bit mispredicts often enough to
         * decode slower than zstd, for few bytes saved; on planes of almost
         * only zeros it decodes faster. */
        uint32_t zeros = hist[0][p][0];
        if (method == 1 && 4.0 * zeros > 3.0 * total && zeros < total &&
            sparse_pays(src, n, width, rotate, sample, p, hist[0][p], total))
            method = 4;
        if (least < total * (1 - saving)) plan |= method << (4 * p);
    }
    return plan;
}

/* Split planes (methods 2 and 3). A float plane whose structure is in its low
 * k bits (k = 2 or 3: with rotate 3, plane 0 ends in the sign and the two top
 * exponent bits, above five near-random mantissa bits) is stored as its high
 * 8 - k bits packed raw, then a zstd frame of its low k bits. Only the low
 * stream is entropy-coded, so coding the plane costs a fraction of zstd on all
 * of it. The plane's n values are cut into S segments of Q = ceil(n / S)
 * (value q*Q + j is slot j of segment q; past n, values are 0), so every
 * loop reads and writes contiguous runs:
 *   k = 2: S = 4, high 3Q bytes, low Q bytes:
 *     high[q*Q + j] = s_q >> 2 | (s_3 >> (2 + 2q) & 3) << 6      (q = 0, 1, 2)
 *     low[j] = s_0 & 3 | (s_1 & 3) << 2 | (s_2 & 3) << 4 | (s_3 & 3) << 6
 *   k = 3: S = 8, high 5Q bytes, low 4Q bytes; t = s_5 >> 3 | (s_6 >> 3) << 5 | (s_7 >> 3) << 10:
 *     high[q*Q + j] = s_q >> 3 | (t >> 3q & 7) << 5               (q = 0 .. 4)
 *     low[r*Q + j] = s_r & 7 | (s_{r+4} & 7) << 4                  (r = 0 .. 3)
 * where s_q is value q*Q + j. bytegroup.py's numpy fallback writes the same. */
static Py_ssize_t split_segment(int method, Py_ssize_t n) {
    return method == 2 ? (n + 3) / 4 : (n + 7) / 8;
}
static Py_ssize_t split_high_len(int method, Py_ssize_t n) {
    return (method == 2 ? 3 : 5) * split_segment(method, n);
}
static Py_ssize_t split_low_len(int method, Py_ssize_t n) {
    return (method == 2 ? 1 : 4) * split_segment(method, n);
}

/* One slot of each method: s[] the segments' values, h[] and l[] the high and
 * low bytes. For method 3, t's 15 bits are taken three at a time in byte
 * arithmetic (t = s5 >> 3 | (s6 >> 3) << 5 | (s7 >> 3) << 10), so the loops
 * below vectorize in byte lanes. */
static inline void split2_slot(const uint8_t *s, uint8_t *h, uint8_t *l) {
    h[0] = (uint8_t)(s[0] >> 2 | (s[3] >> 2 & 3) << 6);
    h[1] = (uint8_t)(s[1] >> 2 | (s[3] >> 4 & 3) << 6);
    h[2] = (uint8_t)(s[2] >> 2 | (s[3] >> 6) << 6);
    l[0] = (uint8_t)((s[0] & 3) | (s[1] & 3) << 2 | (s[2] & 3) << 4 | (s[3] & 3) << 6);
}

static inline void join2_slot(const uint8_t *h, const uint8_t *l, uint8_t *s) {
    s[0] = (uint8_t)((h[0] & 63) << 2 | (l[0] & 3));
    s[1] = (uint8_t)((h[1] & 63) << 2 | (l[0] >> 2 & 3));
    s[2] = (uint8_t)((h[2] & 63) << 2 | (l[0] >> 4 & 3));
    s[3] = (uint8_t)((h[0] >> 6 | (h[1] >> 6) << 2 | (h[2] >> 6) << 4) << 2 | l[0] >> 6);
}

static inline void split3_slot(const uint8_t *s, uint8_t *h, uint8_t *l) {
    uint8_t t[5] = {
        (uint8_t)(s[5] >> 3 & 7),
        (uint8_t)((s[5] >> 6) | (s[6] >> 3 & 1) << 2),
        (uint8_t)(s[6] >> 4 & 7),
        (uint8_t)((s[6] >> 7) | (s[7] >> 3 & 3) << 1),
        (uint8_t)(s[7] >> 5),
    };
    for (int q = 0; q < 5; q++) h[q] = (uint8_t)(s[q] >> 3 | t[q] << 5);
    for (int r = 0; r < 4; r++) l[r] = (uint8_t)((s[r] & 7) | (s[r + 4] & 7) << 4);
}

static inline void join3_slot(const uint8_t *h, const uint8_t *l, uint8_t *s) {
    for (int q = 0; q < 5; q++) s[q] = (uint8_t)((h[q] & 31) << 3);
    s[5] = (uint8_t)(((h[0] >> 5) | (h[1] >> 5 & 3) << 3) << 3);
    s[6] = (uint8_t)(((h[1] >> 7) | (h[2] >> 5) << 1 | (h[3] >> 5 & 1) << 4) << 3);
    s[7] = (uint8_t)(((h[3] >> 6) | (h[4] >> 5) << 2) << 3);
    for (int r = 0; r < 4; r++) s[r] |= l[r] & 7, s[r + 4] |= l[r] >> 4 & 7;
}

/* Segments never overlap, but with up to 17 streams GCC gives up proving it
 * at run time and leaves the loop scalar (many times slower): say so. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_ALIAS _Pragma("GCC ivdep")
#elif defined(__clang__)
#define NO_ALIAS _Pragma("clang loop vectorize(assume_safety)")
#else
#define NO_ALIAS
#endif

/* Slots [0, full) lie inside the plane in every segment: no bounds checks there. */
static Py_ssize_t full_slots(Py_ssize_t n, Py_ssize_t Q, int segments) {
    Py_ssize_t full = n - (segments - 1) * Q;
    return full < 0 ? 0 : full;
}

#define SPLIT_LOOP_BODY(SEGS, HIGH, LOW, SLOT, CHECKED)                        \
    {                                                                          \
        uint8_t sv[SEGS], hv[HIGH], lv[LOW];                                   \
        for (int q = 0; q < SEGS; q++)                                         \
            sv[q] = !(CHECKED) || q * Q + j < n ? p[q * Q + j] : 0;            \
        SLOT(sv, hv, lv);                                                      \
        for (int q = 0; q < HIGH; q++) high[q * Q + j] = hv[q];                \
        for (int r = 0; r < LOW; r++) low[r * Q + j] = lv[r];                  \
    }

/* BODY over every slot: unchecked where every segment holds it, then checked. */
#define FOR_SLOTS(BODY, SEGS, HIGH, LOW, SLOT)                                 \
    {                                                                          \
        Py_ssize_t j = 0, full = full_slots(n, Q, SEGS);                       \
        NO_ALIAS for (; j < full; j++) BODY(SEGS, HIGH, LOW, SLOT, 0)          \
        for (; j < Q; j++) BODY(SEGS, HIGH, LOW, SLOT, 1)                      \
    }

static void split_plane(const uint8_t *restrict p, Py_ssize_t n, int method,
                        uint8_t *restrict high, uint8_t *restrict low) {
    Py_ssize_t Q = split_segment(method, n);
    if (method == 2)
        FOR_SLOTS(SPLIT_LOOP_BODY, 4, 3, 1, split2_slot)
    else
        FOR_SLOTS(SPLIT_LOOP_BODY, 8, 5, 4, split3_slot)
}

#define JOIN_LOOP_BODY(SEGS, HIGH, LOW, SLOT, CHECKED)                         \
    {                                                                          \
        uint8_t sv[SEGS], hv[HIGH], lv[LOW];                                   \
        for (int q = 0; q < HIGH; q++) hv[q] = high[q * Q + j];                \
        for (int r = 0; r < LOW; r++) lv[r] = low[r * Q + j];                  \
        SLOT(hv, lv, sv);                                                      \
        for (int q = 0; q < SEGS; q++)                                         \
            if (!(CHECKED) || q * Q + j < n) p[q * Q + j] = sv[q];             \
    }

/* The inverse of split_plane, into p (n bytes). */
static void join_plane(const uint8_t *restrict high, const uint8_t *restrict low, Py_ssize_t n,
                       int method, uint8_t *restrict p) {
    Py_ssize_t Q = split_segment(method, n);
    if (method == 2)
        FOR_SLOTS(JOIN_LOOP_BODY, 4, 3, 1, join2_slot)
    else
        FOR_SLOTS(JOIN_LOOP_BODY, 8, 5, 4, join3_slot)
}

/* Sparse planes (bytegroup/4). In an XOR delta most bytes did not change
 * and are 0, and zstd, however few bits the zeros' entropy is, spends at
 * least one bit on each. A sparse plane stores a bitmap of the non-zero
 * bytes (bit i % 8 of byte i / 8 set where byte i is not 0; bits past n are
 * 0) and the non-zero bytes in order, each coded on its own (code_sparse),
 * so zstd sees an eighth of the plane's bytes for the bitmap and only the
 * bytes that changed. */
static Py_ssize_t bitmap_len(Py_ssize_t n) { return (n + 7) / 8; }

#if defined(__GNUC__) || defined(__clang__)
#define CTZ(b) __builtin_ctz(b)
#else
static int CTZ(unsigned b) { int c = 0; for (; !(b & 1); b >>= 1) c++; return c; }
#endif

#define LOW7 0x7f7f7f7f7f7f7f7fULL

/* Bit j set where byte j of w is not 0: the top bit of each byte says
 * "not 0" ((low 7 bits + 0x7f) carries into it, or it was set), and one
 * multiply gathers the eight top bits into the top byte (the partial
 * products land on distinct bits, so nothing carries). */
static inline unsigned nonzero_bits(uint64_t w) {
    uint64_t top = (((w & LOW7) + LOW7) | w) & ~LOW7;
    return (unsigned)(((top >> 7) * 0x0102040810204080ULL) >> 56);
}

static inline int popcount64(uint64_t x) {
    x -= (x >> 1) & 0x5555555555555555ULL;
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
    return (int)((x * 0x0101010101010101ULL) >> 56);
}

/* One group of 8 bytes (word) to its bitmap byte, its non-zero bytes
 * appended at values[k]: each byte is stored and k moves past it only if it
 * is not 0, with no branch (a branch per byte or per set bit mispredicts
 * about half the time on a plane of 8-50 % non-zero bytes). Needs 8 bytes of
 * room at values[k]. */
static inline Py_ssize_t gather_group(uint64_t word, uint8_t *restrict bitmap_byte,
                                      uint8_t *restrict values, Py_ssize_t k) {
    unsigned bits = nonzero_bits(word);
    *bitmap_byte = (uint8_t)bits;
    for (; bits; bits &= bits - 1) values[k++] = (uint8_t)(word >> (8 * CTZ(bits)));
    return k;
}

/* The bitmap and the non-zero bytes of p (n bytes) into bitmap
 * (bitmap_len(n)) and values (room for n): their count. 64 bytes of zeros
 * (8 loads, one test) cost one bitmap store: most of an XOR plane. */
static Py_ssize_t sparse_plane(const uint8_t *restrict p, Py_ssize_t n, uint8_t *restrict bitmap,
                               uint8_t *restrict values) {
    Py_ssize_t k = 0, i = 0;
    for (; i + 64 <= n; i += 64) {
        uint64_t w[8], any = 0;
        memcpy(w, p + i, 64);
        for (int q = 0; q < 8; q++) any |= w[q];
        if (!any) {
            memset(bitmap + (i >> 3), 0, 8);
            continue;
        }
        for (int q = 0; q < 8; q++) k = gather_group(w[q], bitmap + (i >> 3) + q, values, k);
    }
    for (; i < n; i += 8) { /* the tail: zeros past n; values[k] stays below n */
        uint64_t word = 0;
        memcpy(&word, p + i, (size_t)(n - i < 8 ? n - i : 8));
        unsigned bits = nonzero_bits(word);
        bitmap[i >> 3] = (uint8_t)bits;
        for (; bits; bits &= bits - 1) values[k++] = (uint8_t)(word >> (8 * CTZ(bits)));
    }
    return k;
}

/* The set bits of a bitmap for n bytes, or -1 if a bit past n is set. */
static Py_ssize_t bitmap_count(const uint8_t *bitmap, Py_ssize_t n) {
    Py_ssize_t len = bitmap_len(n), count = 0, g = 0;
    for (; g + 8 <= len; g += 8) {
        uint64_t word;
        memcpy(&word, bitmap + g, 8);
        count += popcount64(word);
    }
    for (; g < len; g++) count += popcount64(bitmap[g]);
    if (n & 7 && bitmap[len - 1] >> (n & 7)) return -1;
    return count;
}

/* The inverse of sparse_plane, into p (n bytes). The caller has checked
 * that the bitmap sets exactly `count` bits, all below n (bitmap_count), so
 * values[] is read only below count and p written only below n. 64 bytes
 * whose bitmap is 0 are one memset; a group is built in a register without
 * a branch per byte (gather_group says why) while 8 values remain, then one
 * step per set bit. */
static void join_sparse(const uint8_t *restrict bitmap, const uint8_t *restrict values,
                        Py_ssize_t n, Py_ssize_t count, uint8_t *restrict p) {
    Py_ssize_t k = 0, i = 0;
    for (; i + 64 <= n; i += 64) {
        uint64_t groups;
        memcpy(&groups, bitmap + (i >> 3), 8);
        if (!groups) {
            memset(p + i, 0, 64);
            continue;
        }
        for (int q = 0; q < 8; q++) {
            unsigned bits = (unsigned)(groups >> (8 * q)) & 255;
            uint64_t word = 0;
            for (; bits; bits &= bits - 1) word |= (uint64_t)values[k++] << (8 * CTZ(bits));
            memcpy(p + i + 8 * q, &word, 8);
        }
    }
    for (; i < n; i += 8) {
        uint64_t word = 0;
        for (unsigned bits = bitmap[i >> 3]; bits; bits &= bits - 1)
            word |= (uint64_t)values[k++] << (8 * CTZ(bits));
        memcpy(p + i, &word, (size_t)(n - i < 8 ? n - i : 8));
    }
}

/* split(src, dst, width, rotate, sample=0, saving=0.0) -> plan
 *
 * With `sample` > 0, first judges the planes on a sample (judge) and splits
 * only if one is worth coding: one call, one GIL release per chunk. Returns
 * the plan, each plane's method in its nibble (1 for every plane when
 * `sample` is 0); 0 means dst is untouched. */
static PyObject *split(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int width, rotate;
    Py_ssize_t sample = 0;
    double saving = 0.0;
    if (!PyArg_ParseTuple(args, "y*w*ii|nd", &src, &dst, &width, &rotate, &sample, &saving))
        return NULL;
    PyObject *result = NULL;
    if (check_layout(width, rotate) < 0) goto done;
    if (src.len % width) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole %d-byte values", src.len, width);
        goto done;
    }
    if (dst.len < src.len) {
        PyErr_Format(PyExc_ValueError, "plane buffer of %zd bytes, need %zd", dst.len, src.len);
        goto done;
    }
    if (sample < 0 || (sample > 0 && sample < SLICES)) {
        PyErr_Format(PyExc_ValueError, "sample must be 0 or at least %d values", SLICES);
        goto done;
    }
    unsigned long plan = 0;
    for (int p = 0; p < width; p++) plan |= 1ul << (4 * p);
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t n = src.len / width;
    if (sample) plan = judge(src.buf, n, width, rotate, sample, saving);
    if (plan) split_words(src.buf, dst.buf, n, width, rotate);
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLong(plan);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* split_plane(plane, high, low, method) and join_plane(high, low, plane,
 * method): a plane to its split form (split_plane above) and back. */
static PyObject *split_or_join_plane(PyObject *args, int join) {
    Py_buffer a, b, c;
    int method;
    if (!PyArg_ParseTuple(args, join ? "y*y*w*i" : "y*w*w*i", &a, &b, &c, &method)) return NULL;
    Py_buffer *plane = join ? &c : &a, *high = join ? &a : &b, *low = join ? &b : &c;
    PyObject *result = NULL;
    Py_ssize_t n = plane->len;
    if (method != 2 && method != 3) {
        PyErr_Format(PyExc_ValueError, "split method must be 2 or 3, not %d", method);
        goto done;
    }
    if (high->len != split_high_len(method, n) || low->len != split_low_len(method, n)) {
        PyErr_Format(PyExc_ValueError, "a split of %zd bytes has %zd high and %zd low bytes",
                     n, split_high_len(method, n), split_low_len(method, n));
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (join)
        join_plane(high->buf, low->buf, n, method, plane->buf);
    else
        split_plane(plane->buf, n, method, high->buf, low->buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&c);
    return result;
}

static PyObject *py_split_plane(PyObject *self, PyObject *args) {
    return split_or_join_plane(args, 0);
}

static PyObject *py_join_plane(PyObject *self, PyObject *args) {
    return split_or_join_plane(args, 1);
}

/* sparse_plane(plane, bitmap, values) -> count: a plane's bitmap and its
 * non-zero bytes (values[:count]; values has room for the whole plane). */
static PyObject *py_sparse_plane(PyObject *self, PyObject *args) {
    Py_buffer plane, bitmap, values;
    if (!PyArg_ParseTuple(args, "y*w*w*", &plane, &bitmap, &values)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = plane.len, count;
    if (bitmap.len != bitmap_len(n) || values.len < n) {
        PyErr_Format(PyExc_ValueError,
                     "a sparse plane of %zd bytes needs a bitmap of %zd and room for %zd values, "
                     "not %zd and %zd", n, bitmap_len(n), n, bitmap.len, values.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    count = sparse_plane(plane.buf, n, bitmap.buf, values.buf);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(count);
done:
    PyBuffer_Release(&plane);
    PyBuffer_Release(&bitmap);
    PyBuffer_Release(&values);
    return result;
}

/* The count of a sparse plane's bitmap for n bytes; -1 with ValueError set if
 * the bitmap has the wrong length or sets a bit past n. */
static Py_ssize_t checked_count(const Py_buffer *bitmap, Py_ssize_t n) {
    if (bitmap->len != bitmap_len(n)) {
        PyErr_Format(PyExc_ValueError, "a sparse plane of %zd bytes has a %zd-byte bitmap, not %zd",
                     n, bitmap_len(n), bitmap->len);
        return -1;
    }
    Py_ssize_t count = bitmap_count(bitmap->buf, n);
    if (count < 0)
        PyErr_Format(PyExc_ValueError, "sparse plane bitmap marks bytes past the plane's %zd", n);
    return count;
}

/* sparse_count(bitmap, n) -> count: the non-zero bytes a bitmap marks. */
static PyObject *py_sparse_count(PyObject *self, PyObject *args) {
    Py_buffer bitmap;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*n", &bitmap, &n)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = n < 0 ? -1 : checked_count(&bitmap, n);
    if (n < 0) PyErr_SetString(PyExc_ValueError, "a plane has at least 0 bytes");
    if (count >= 0) result = PyLong_FromSsize_t(count);
    PyBuffer_Release(&bitmap);
    return result;
}

/* join_sparse(bitmap, values, plane): the inverse of sparse_plane, into plane. */
static PyObject *py_join_sparse(PyObject *self, PyObject *args) {
    Py_buffer bitmap, values, plane;
    if (!PyArg_ParseTuple(args, "y*y*w*", &bitmap, &values, &plane)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = checked_count(&bitmap, plane.len);
    if (count < 0) goto done;
    if (count != values.len) {
        PyErr_Format(PyExc_ValueError,
                     "sparse plane bitmap marks %zd non-zero bytes, its values are %zd", count,
                     values.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    join_sparse(bitmap.buf, values.buf, plane.len, count, plane.buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&bitmap);
    PyBuffer_Release(&values);
    PyBuffer_Release(&plane);
    return result;
}

/* XOR: the values are XORed into what dst holds (a delta chunk decoded onto
 * its reference's bytes, codecs/delta.py), in the same pass. */
#define JOIN_LOOP(T, W, XOR)                                                   \
    for (Py_ssize_t i = 0; i < n; i++) {                                       \
        T v = 0;                                                               \
        for (int p = 0; p < W; p++) v |= (T)((T)pl[p][i] << (8 * p));          \
        if (r) v = (T)((T)(v >> r) | (T)(v << (8 * W - r)));                   \
        if (XOR) {                                                             \
            T old;                                                             \
            memcpy(&old, dst + i * W, W);                                      \
            v ^= old;                                                          \
        }                                                                      \
        memcpy(dst + i * W, &v, W);                                            \
    }

static void join_words(const uint8_t *const *pl, uint8_t *restrict dst, Py_ssize_t n, int width,
                       int r, int xor) {
    if (xor) {
        switch (width) {
        case 1:
            for (Py_ssize_t i = 0; i < n; i++) dst[i] ^= pl[0][i];
            break;
        case 2: JOIN_LOOP(uint16_t, 2, 1) break;
        case 4: JOIN_LOOP(uint32_t, 4, 1) break;
        default: JOIN_LOOP(uint64_t, 8, 1) break;
        }
        return;
    }
    switch (width) {
    case 1: memcpy(dst, pl[0], (size_t)n); break;
    case 2: JOIN_LOOP(uint16_t, 2, 0) break;
    case 4: JOIN_LOOP(uint32_t, 4, 0) break;
    default: JOIN_LOOP(uint64_t, 8, 0) break;
    }
}

static PyObject *join(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_buffer dst;
    int width, rotate, xor = 0;
    if (!PyArg_ParseTuple(args, "Ow*ii|p", &seq, &dst, &width, &rotate, &xor)) return NULL;
    Py_buffer planes[8];
    int held = 0;
    PyObject *result = NULL;
    if (check_layout(width, rotate) < 0) goto done;
    if (!PySequence_Check(seq) || PySequence_Size(seq) != width) {
        PyErr_Format(PyExc_ValueError, "need a sequence of %d planes", width);
        goto done;
    }
    if (dst.len % width) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole %d-byte values", dst.len, width);
        goto done;
    }
    Py_ssize_t n = dst.len / width;
    for (; held < width; held++) {
        PyObject *item = PySequence_GetItem(seq, held);
        if (item == NULL) goto done;
        int rc = PyObject_GetBuffer(item, &planes[held], PyBUF_SIMPLE);
        Py_DECREF(item);
        if (rc < 0) goto done;
        if (planes[held].len != n) {
            PyErr_Format(PyExc_ValueError, "plane %d has %zd bytes, expected %zd", held,
                         planes[held].len, n);
            held++;
            goto done;
        }
    }
    {
        uint8_t *d = dst.buf;
        const uint8_t *pl[8];
        for (int p = 0; p < width; p++) pl[p] = planes[p].buf;
        Py_BEGIN_ALLOW_THREADS
        join_words((const uint8_t *const *)pl, d, n, width, rotate, xor);
        Py_END_ALLOW_THREADS
    }
    result = Py_NewRef(Py_None);
done:
    for (int p = 0; p < held; p++) PyBuffer_Release(&planes[p]);
    PyBuffer_Release(&dst);
    return result;
}

/* ---------------------------------------------------------------- libzstd */

#ifdef HAVE_DLOPEN
/* zstd's stable API (zstd.h, 1.4.0 and later): prototypes and parameter
 * numbers, declared here so that building needs no zstd headers. */
typedef void *(*zstd_create_fn)(void);
typedef size_t (*zstd_free_fn)(void *);
typedef size_t (*zstd_set_fn)(void *, int, int);
typedef size_t (*zstd_compress2_fn)(void *, void *, size_t, const void *, size_t);
typedef unsigned (*zstd_is_error_fn)(size_t);
typedef unsigned (*zstd_version_fn)(void);

static zstd_create_fn zstd_create;
static zstd_free_fn zstd_free;
static zstd_set_fn zstd_set;
static zstd_compress2_fn zstd_compress2;
static zstd_is_error_fn zstd_is_error;
static unsigned zstd_version;
static pthread_key_t cctx_key;

/* The settings of zstd.py's _PLANE_PARAMS (zstd as an entropy coder):
 * windowLog, hashLog, chainLog, searchLog, minMatch, targetLength,
 * strategy (1 = fast), contentSizeFlag, checksumFlag. */
static const int PLANE_PARAMS[][2] = {
    {101, 17}, {102, 6}, {103, 6}, {104, 1}, {105, 7}, {106, 0}, {107, 1}, {200, 1}, {201, 0},
};

/* Then, where libzstd takes them: the fast strategy's acceleration
 * (targetLength 128: the match search skips ahead through bytes that do not
 * repeat, which byte planes mostly are) with Huffman-coded literals kept on
 * (literalCompressionMode = 1; by itself an acceleration turns them off).
 * python-zstandard cannot set the second, so the numpy fallback keeps
 * _PLANE_PARAMS and writes other (equally valid) frames. On the XOR deltas
 * of a fine-tuning step this codes and decodes somewhat faster and slightly
 * smaller; on whole checkpoints it changes neither time nor size measurably. */
static const int PLANE_FAST[][2] = {{106, 128}, {1002, 1}};

static void free_cctx(void *cctx) { zstd_free(cctx); }

static void load_zstd(void) {
    static const char *names[] = {"libzstd.so.1", "libzstd.1.dylib", "libzstd.dylib"};
    void *lib = NULL;
    for (size_t i = 0; i < sizeof names / sizeof *names && !lib; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;
    zstd_version_fn version = (zstd_version_fn)dlsym(lib, "ZSTD_versionNumber");
    zstd_create = (zstd_create_fn)dlsym(lib, "ZSTD_createCCtx");
    zstd_free = (zstd_free_fn)dlsym(lib, "ZSTD_freeCCtx");
    zstd_set = (zstd_set_fn)dlsym(lib, "ZSTD_CCtx_setParameter");
    zstd_compress2 = (zstd_compress2_fn)dlsym(lib, "ZSTD_compress2");
    zstd_is_error = (zstd_is_error_fn)dlsym(lib, "ZSTD_isError");
    if (!version || !zstd_create || !zstd_free || !zstd_set || !zstd_compress2 || !zstd_is_error ||
        version() < 10400 || pthread_key_create(&cctx_key, free_cctx) != 0)
        return; /* the library stays loaded: harmless, and never unloaded anyway */
    zstd_version = version();
}

/* This thread's compression context with the plane settings; NULL if out of memory. */
static void *thread_cctx(void) {
    void *cctx = pthread_getspecific(cctx_key);
    if (cctx) return cctx;
    cctx = zstd_create();
    if (!cctx) return NULL;
    for (size_t i = 0; i < sizeof PLANE_PARAMS / sizeof *PLANE_PARAMS; i++) {
        if (zstd_is_error(zstd_set(cctx, PLANE_PARAMS[i][0], PLANE_PARAMS[i][1]))) {
            zstd_free(cctx);
            return NULL;
        }
    }
    /* Literals first: an acceleration without Huffman literals would code worse. */
    if (!zstd_is_error(zstd_set(cctx, PLANE_FAST[1][0], PLANE_FAST[1][1])))
        (void)zstd_set(cctx, PLANE_FAST[0][0], PLANE_FAST[0][1]);
    if (pthread_setspecific(cctx_key, cctx) != 0) {
        zstd_free(cctx);
        return NULL;
    }
    return cctx;
}

/* Room that always holds a plane's frame: zstd.plane_bound. */
static Py_ssize_t plane_bound(Py_ssize_t n) { return n + (n >> 8) + 1024; }

/* Scratch past the planes: a split's low stream (4 * ceil(n / 8) <= n / 2 + 4
 * bytes), or a sparse plane's bitmap (ceil(n / 8)) then room for n values. */
static Py_ssize_t extra_room(Py_ssize_t n) { return n + n / 8 + 16; }

/* A sparse plane (sparse_plane's bitmap, then `count` values) into out
 * (n bytes of room, the plane's raw size): u32 bitmap length, the bitmap,
 * the values. Each of the two is one zstd frame where that is smaller, else
 * raw (so a length equal to the raw one says raw). Returns the length, or -1
 * where it would not be smaller than n (the plane is then stored raw). */
static Py_ssize_t code_sparse(void *cctx, const uint8_t *bitmap, const uint8_t *values,
                              Py_ssize_t count, Py_ssize_t n, uint8_t *out) {
    Py_ssize_t blen = bitmap_len(n), at = 4;
    if (at + blen >= n) return -1;
    size_t k = zstd_compress2(cctx, out + at, (size_t)blen, bitmap, (size_t)blen);
    if (zstd_is_error(k) || (Py_ssize_t)k >= blen) {
        memcpy(out + at, bitmap, (size_t)blen);
        k = (size_t)blen;
    }
    uint32_t stored = (uint32_t)k;
    memcpy(out, &stored, 4); /* u32, little-endian hosts only */
    at += (Py_ssize_t)k;
    if (count == 0) return at;
    Py_ssize_t room = n - at < count ? n - at : count;
    if (room <= 0) return -1;
    k = zstd_compress2(cctx, out + at, (size_t)room, values, (size_t)count);
    if (!zstd_is_error(k) && (Py_ssize_t)k < room) return at + (Py_ssize_t)k;
    if (count > n - at) return -1;
    memcpy(out + at, values, (size_t)count);
    return at + count;
}

/* Codes one chunk into `out` (`cap` bytes; layout in bytegroup.py): its
 * length, 0 when no plane pays, -1 without a compression context (out of
 * memory). `planes` holds the planes, then extra_room(n) bytes of scratch. */
static Py_ssize_t encode_chunk(const uint8_t *src, Py_ssize_t n, int width, int rotate,
                               Py_ssize_t sample, double saving, double min_saving,
                               uint8_t *planes, uint8_t *out, Py_ssize_t cap) {
    unsigned long plan = judge(src, n, width, rotate, sample, saving);
    if (!plan) return 0;
    void *cctx = thread_cctx();
    if (!cctx) return -1;
    split_words(src, planes, n, width, rotate);
    uint8_t *low = planes + (Py_ssize_t)width * n;
    Py_ssize_t pos = 1 + 5 * (Py_ssize_t)width;
    int coded = 0;
    out[0] = (uint8_t)width;
    for (int p = 0; p < width; p++) {
        const uint8_t *plane = planes + (Py_ssize_t)p * n;
        int method = (int)(plan >> (4 * p) & 15);
        Py_ssize_t length = n;
        if (method == 1) {
            length = (Py_ssize_t)zstd_compress2(cctx, out + pos, (size_t)(cap - pos), plane,
                                                (size_t)n);
        } else if (method == 4) {
            Py_ssize_t count = sparse_plane(plane, n, low, low + bitmap_len(n));
            length = code_sparse(cctx, low, low + bitmap_len(n), count, n, out + pos);
            if (length < 0) length = n, method = 0;
        } else if (method) { /* 2 or 3: the high bits raw, then the low stream's frame */
            Py_ssize_t high = split_high_len(method, n);
            split_plane(plane, n, method, out + pos, low);
            size_t k = zstd_compress2(cctx, out + pos + high, (size_t)(cap - pos - high), low,
                                      (size_t)split_low_len(method, n));
            length = zstd_is_error(k) ? (Py_ssize_t)k : high + (Py_ssize_t)k;
        }
        /* zstd fails only for want of room, which means it did not pay. */
        if (method && (zstd_is_error((size_t)length) || length >= n * (1 - min_saving))) {
            method = 0;
            length = n;
        }
        if (!method) memcpy(out + pos, plane, (size_t)n);
        coded |= method != 0;
        uint32_t stored = (uint32_t)length;
        out[1 + 5 * p] = (uint8_t)method;
        memcpy(out + 2 + 5 * p, &stored, 4); /* u32, little-endian hosts only */
        pos += length;
    }
    return coded ? pos : 0;
}
#endif

/* encode(src, out, planes, width, rotate, sample, saving, min_saving) -> int | None */
static PyObject *encode(PyObject *self, PyObject *args) {
    Py_buffer src, out, planes;
    int width, rotate;
    Py_ssize_t sample;
    double saving, min_saving;
    if (!PyArg_ParseTuple(args, "y*w*w*iindd", &src, &out, &planes, &width, &rotate, &sample,
                          &saving, &min_saving))
        return NULL;
    PyObject *result = NULL;
#ifdef HAVE_DLOPEN
    if (!zstd_version) {
        PyErr_SetString(PyExc_RuntimeError, "no libzstd was found (HAS_ZSTD is False)");
        goto done;
    }
    if (check_layout(width, rotate) < 0) goto done;
    if (width == 1 || src.len % width) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole values of 2, 4 or 8 bytes (%d)",
                     src.len, width);
        goto done;
    }
    Py_ssize_t n = src.len / width;
    if (out.len < 1 + 5 * width + src.len + plane_bound(n) || planes.len < src.len + extra_room(n)) {
        PyErr_Format(PyExc_ValueError, "buffers of %zd and %zd bytes are too small for %zd bytes",
                     out.len, planes.len, src.len);
        goto done;
    }
    if (sample < SLICES) {
        PyErr_Format(PyExc_ValueError, "sample must be at least %d values", SLICES);
        goto done;
    }
    Py_ssize_t length;
    Py_BEGIN_ALLOW_THREADS
    length = encode_chunk(src.buf, n, width, rotate, sample, saving, min_saving, planes.buf,
                          out.buf, out.len);
    Py_END_ALLOW_THREADS
    if (length < 0)
        PyErr_NoMemory();
    else
        result = length ? PyLong_FromSsize_t(length) : Py_NewRef(Py_None);
#else
    PyErr_SetString(PyExc_RuntimeError, "no libzstd on this platform (HAS_ZSTD is False)");
    goto done;
#endif
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    PyBuffer_Release(&planes);
    return result;
}

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS,
     "split(src, dst, width, rotate, sample=0, saving=0.0) -> plan: plane p of every rotated "
     "word into dst[p*n:(p+1)*n]; with a sample, only if a plane is judged worth coding. The "
     "plan holds each plane's method in nibble p (0 raw, 1 zstd, 2 or 3 split, 4 sparse; 0: nothing "
     "written)."},
    {"encode", encode, METH_VARARGS,
     "encode(src, out, planes, width, rotate, sample, saving, min_saving) -> length | None: a "
     "float chunk's bytegroup payload into out (None: no plane pays); planes has room for the "
     "planes and n + n // 8 + 16 bytes more; needs HAS_ZSTD."},
    {"join", join, METH_VARARGS,
     "join(planes, dst, width, rotate, xor=False): the inverse of split, into dst "
     "(XORed into what dst holds if xor)."},
    {"split_plane", py_split_plane, METH_VARARGS,
     "split_plane(plane, high, low, method): a plane's high bits and low stream for split "
     "method 2 or 3."},
    {"join_plane", py_join_plane, METH_VARARGS,
     "join_plane(high, low, plane, method): the inverse of split_plane, into plane."},
    {"sparse_plane", py_sparse_plane, METH_VARARGS,
     "sparse_plane(plane, bitmap, values) -> count: the bitmap of plane's non-zero bytes and "
     "those bytes, into values[:count] (values has room for the plane)."},
    {"sparse_count", py_sparse_count, METH_VARARGS,
     "sparse_count(bitmap, n) -> count: the non-zero bytes a sparse plane's bitmap marks; "
     "ValueError if it has the wrong length or marks bytes past n."},
    {"join_sparse", py_join_sparse, METH_VARARGS,
     "join_sparse(bitmap, values, plane): the inverse of sparse_plane, into plane; ValueError if "
     "the bitmap does not mark exactly len(values) bytes of the plane."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_planes", "Byte-plane kernels for the bytegroup codec.", -1, methods,
};

PyMODINIT_FUNC PyInit__planes(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    unsigned version = 0;
#ifdef HAVE_DLOPEN
    load_zstd();
    version = zstd_version;
    /* PLANE_PARAMS: ((zstd parameter, value), ...), for tests to hold them
     * equal to zstd._PLANE_PARAMS, their Python twin. */
    size_t count = sizeof PLANE_PARAMS / sizeof *PLANE_PARAMS;
    PyObject *params = PyTuple_New((Py_ssize_t)count);
    for (size_t i = 0; params && i < count; i++) {
        PyObject *pair = Py_BuildValue("(ii)", PLANE_PARAMS[i][0], PLANE_PARAMS[i][1]);
        if (!pair) Py_CLEAR(params);
        else PyTuple_SET_ITEM(params, (Py_ssize_t)i, pair);
    }
    if (!params || PyModule_AddObject(m, "PLANE_PARAMS", params) < 0) {
        Py_XDECREF(params);
        Py_DECREF(m);
        return NULL;
    }
#endif
    /* ZSTD_VERSION: libzstd's version number (e.g. 10504), 0 when none was found. */
    if (PyModule_AddIntConstant(m, "ZSTD_VERSION", (long)version) < 0 ||
        PyModule_AddObjectRef(m, "HAS_ZSTD", version ? Py_True : Py_False) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
