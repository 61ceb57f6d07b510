// The native CPU wire kernels of comm.native (see its docstring): C loops, compiled as C++ by
// torch.utils.cpp_extension into a small pybind11 module (no torch/extension.h: the functions take
// the tensors' data pointers as integers and their sizes, as plain C functions would). The kernel
// bodies are C (they compile as C11 too); the module at the end only binds them.
// QBLOCK (elements per quantizer block) comes from comm.native as -DQBLOCK=..., its one definition.
#include <stdint.h>
#include <string.h>
#include <math.h>

#include <pybind11/pybind11.h>

#ifndef QBLOCK
#error "QBLOCK must be defined (comm.native passes -DQBLOCK)"
#endif

namespace {

static inline float bf16_f32(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float ld_f32(const float* x, int64_t i) { return x[i]; }
static inline double ld_f64(const double* x, int64_t i) { return x[i]; }
static inline float ld_bf16(const uint16_t* x, int64_t i) { return bf16_f32(x[i]); }

/* float -> int32 as x86 cvtt: NaN and out-of-range give INT32_MIN (values here are clamped) */
static inline int32_t to_i32f(float v) { return v != v ? INT32_MIN : (int32_t)v; }
static inline int32_t to_i32d(double v) { return v != v ? INT32_MIN : (int32_t)v; }

/* ---- tb(x) flags -> packed bits: byte j bit k = x[8j+k] > 0 or (x == 0 and odd) ---- */
#define SIGN_BITS(NAME, T, LD)                                                             \
void NAME(const T* x, int64_t nb, int32_t odd, uint8_t* out) {                             \
    const int o = odd != 0;                                                                \
    for (int64_t j = 0; j < nb; j++) {                                                     \
        uint32_t b = 0;                                                                    \
        for (int k = 0; k < 8; k++) {                                                      \
            __typeof__(LD(x, 0)) v = LD(x, 8 * j + k);                                     \
            b |= (uint32_t)((v > 0) | ((v == 0) & o)) << k;                                \
        }                                                                                  \
        out[j] = (uint8_t)b;                                                               \
    }                                                                                      \
}
SIGN_BITS(ln_sign_bits_f32, float, ld_f32)
SIGN_BITS(ln_sign_bits_f64, double, ld_f64)
SIGN_BITS(ln_sign_bits_bf16, uint16_t, ld_bf16)

/* ---- levels == 0 lanes: 1 where c > 0, or c not < 0 on odd steps; 8 / bits lanes per byte ---- */
/* In chunks: the 0/1 flags as bytes (a loop the compiler vectorises), then 8 / bits flag bytes read
   as one little-endian word and folded into one byte (lane i = byte i). */
#define TB_LANES(NAME, T, LD)                                                              \
void NAME(const T* x, int64_t words, int32_t odd, int32_t bits, uint8_t* out) {            \
    enum { C = 4096 };                                                                     \
    const int o = odd != 0, per = 8 / bits;                                                \
    uint8_t f[C];                                                                          \
    for (int64_t w0 = 0; w0 < words; w0 += C / 8) {                                        \
        const int64_t nw = words - w0 < C / 8 ? words - w0 : C / 8;                        \
        const int64_t ne = nw * per;                                                       \
        const T* xc = x + w0 * per;                                                        \
        for (int64_t e = 0; e < ne; e++) {                                                 \
            __typeof__(LD(x, 0)) v = LD(xc, e);                                            \
            f[e] = (uint8_t)((v > 0) | (!(v < 0) & o));                                    \
        }                                                                                  \
        uint8_t* oc = out + w0;                                                            \
        switch (bits) {                                                                    \
        case 1:                                                                            \
            for (int64_t w = 0; w < nw; w++) {                                             \
                uint64_t t; memcpy(&t, f + 8 * w, 8);                                      \
                oc[w] = (uint8_t)((t * 0x0102040810204080ull) >> 56);                      \
            }                                                                              \
            break;                                                                         \
        case 2:                                                                            \
            for (int64_t w = 0; w < nw; w++) {                                             \
                uint32_t t; memcpy(&t, f + 4 * w, 4);                                      \
                oc[w] = (uint8_t)((t & 1) | ((t >> 6) & 4) | ((t >> 12) & 16) | ((t >> 18) & 64)); \
            }                                                                              \
            break;                                                                         \
        case 4:                                                                            \
            for (int64_t w = 0; w < nw; w++) {                                             \
                uint16_t t; memcpy(&t, f + 2 * w, 2);                                      \
                oc[w] = (uint8_t)((t & 1) | ((t >> 4) & 16));                              \
            }                                                                              \
            break;                                                                         \
        default:                                                                           \
            memcpy(oc, f, (size_t)nw);                                                     \
        }                                                                                  \
    }                                                                                      \
}
TB_LANES(ln_tb_lanes_f32, float, ld_f32)
TB_LANES(ln_tb_lanes_f64, double, ld_f64)
TB_LANES(ln_tb_lanes_bf16, uint16_t, ld_bf16)

/* ---- majority: r = P rows of c bytes; bit k of out[j] = count over rows of bit k >= thr ---- */
void ln_majority(const uint8_t* r, int64_t P, int64_t c, int64_t thr, uint8_t* out) {
    enum { B = 256 };
    uint8_t cnt[8][B];
    for (int64_t j0 = 0; j0 < c; j0 += B) {
        const int m = (int)(c - j0 < B ? c - j0 : B);
        memset(cnt, 0, sizeof cnt);
        for (int64_t p = 0; p < P; p++) {
            const uint8_t* row = r + p * c + j0;
            for (int k = 0; k < 8; k++)
                for (int j = 0; j < m; j++) cnt[k][j] += (row[j] >> k) & 1;
        }
        for (int j = 0; j < m; j++) {
            uint32_t b = 0;
            for (int k = 0; k < 8; k++) b |= (uint32_t)(cnt[k][j] >= thr) << k;
            out[j0 + j] = (uint8_t)b;
        }
    }
}

/* ---- Lion Cub eq. 1 over whole blocks into lanes: v = clamp(round(x * s), -L, L) + L ---- */
/* Per block: the lane values as int32 (a pass the compiler vectorises), then the packing with
   the lane width a constant (one loop per width). S: the scale's type; block b uses scale[b];
   out: bytes (bits 1..8) or int32 words of two lanes (16). */
#define PACK(B)                                                                            \
    for (int w = 0; w < QBLOCK / (8 / B); w++) {                                           \
        uint32_t acc = 0;                                                                  \
        for (int i = 0; i < 8 / B; i++) acc += (uint32_t)v[w * (8 / B) + i] << (B * i);   \
        out[w] = (uint8_t)acc;                                                             \
    }
static void pack_block(const int32_t* v, int bits, void* out_) {
    if (bits == 16) {
        int32_t* out = (int32_t*)out_;
        for (int w = 0; w < QBLOCK / 2; w++)
            out[w] = (int32_t)((uint32_t)v[2 * w] + ((uint32_t)v[2 * w + 1] << 16));
        return;
    }
    uint8_t* out = (uint8_t*)out_;
    switch (bits) {
    case 1: PACK(1) break;
    case 2: PACK(2) break;
    case 4: PACK(4) break;
    default: PACK(8) break;
    }
}

/* ROUND: the rounding of y = x * s in place (e: the element's index in its block, ub: the block's
   uniforms, NULL for nearest rounding). q = int8(y) as the reference converts (a NaN y, from an inf
   in the tensor that makes its scale 0, gives q = 0 there), then the lane value q + L. */
#define QUANT_LOOP(T, S, LD, CVT, ROUND)                                                   \
    const int64_t wbytes = (int64_t)QBLOCK * bits / 8;                                     \
    const S lo = (S)(-L), hi = (S)L;                                                       \
    int32_t v[QBLOCK];                                                                     \
    for (int64_t b = 0; b < nb; b++) {                                                     \
        const S s = scale[b];                                                              \
        const T* xb = x + b * QBLOCK;                                                      \
        const S* ub = u ? u + b * QBLOCK : 0;                                              \
        (void)ub;                                                                          \
        for (int e = 0; e < QBLOCK; e++) {                                                 \
            S y = (S)LD(xb, e) * s;                                                        \
            ROUND;                                                                         \
            y = y < lo ? lo : (y > hi ? hi : y);                                           \
            v[e] = (int32_t)(int8_t)CVT(y) + L;                                            \
        }                                                                                  \
        pack_block(v, bits, (uint8_t*)out_ + b * wbytes);                                  \
    }

/* nearest: round half to even (the current rounding mode, as torch.round) */
#define QUANT(NAME, T, S, LD, RND, CVT)                                                    \
void NAME(const T* x, int64_t nb, const S* scale, int32_t L, int32_t bits, void* out_) {   \
    const S* u = 0;                                                                        \
    QUANT_LOOP(T, S, LD, CVT, y = RND(y))                                                  \
}
QUANT(ln_quant_f32, float, float, ld_f32, nearbyintf, to_i32f)
QUANT(ln_quant_bf16, uint16_t, float, ld_bf16, nearbyintf, to_i32f)
QUANT(ln_quant_f64, double, double, ld_f64, nearbyint, to_i32d)

/* stochastic: low = floor(y); y = low + (u < y - low); u: one uniform per element */
#define QUANT_STOCH(NAME, T, S, LD, FLOOR, CVT)                                            \
void NAME(const T* x, int64_t nb, const S* scale, const S* u, int32_t L, int32_t bits,     \
          void* out_) {                                                                    \
    QUANT_LOOP(T, S, LD, CVT, { S f = FLOOR(y); y = f + (S)(ub[e] < y - f); })             \
}
QUANT_STOCH(ln_quant_stoch_f32, float, float, ld_f32, floorf, to_i32f)
QUANT_STOCH(ln_quant_stoch_bf16, uint16_t, float, ld_bf16, floorf, to_i32f)
QUANT_STOCH(ln_quant_stoch_f64, double, double, ld_f64, floor, to_i32d)

/* ---- summed wire -> int8 sign(mul * v - offset) per lane; words: whole wire words ---- */
/* bits <= 8: a table from the byte to its 8 / bits signs, stored as one word per byte */
#define UNPACK_LUT(B, W)                                                                   \
    {                                                                                      \
        W lut[256];                                                                        \
        for (int byte = 0; byte < 256; byte++) {                                           \
            uint64_t acc = 0;                                                              \
            for (int i = 0; i < 8 / B; i++) {                                              \
                int32_t t = (int32_t)((byte >> (B * i)) & ((1 << B) - 1)) * mul - (int32_t)offset; \
                acc |= (uint64_t)(uint8_t)(int8_t)((t > 0) - (t < 0)) << (8 * i);          \
            }                                                                              \
            lut[byte] = (W)acc;                                                            \
        }                                                                                  \
        const uint8_t* wire = (const uint8_t*)wire_;                                       \
        for (int64_t w = 0; w < words; w++) {                                              \
            W val = lut[wire[w]];                                                          \
            memcpy(out + w * (8 / B), &val, sizeof(W));                                    \
        }                                                                                  \
    }
void ln_unpack_sign(const void* wire_, int64_t words, int32_t bits, int32_t mul, int64_t offset, int8_t* out) {
    if (bits == 16) {
        const uint32_t* wire = (const uint32_t*)wire_;
        for (int64_t w = 0; w < words; w++) {
            for (int i = 0; i < 2; i++) {
                int64_t t = (int64_t)((wire[w] >> (16 * i)) & 0xFFFF) * mul - offset;
                out[2 * w + i] = (int8_t)((t > 0) - (t < 0));
            }
        }
        return;
    }
    switch (bits) {
    case 1: UNPACK_LUT(1, uint64_t) break;
    case 2: UNPACK_LUT(2, uint32_t) break;
    case 4: UNPACK_LUT(4, uint16_t) break;
    default: UNPACK_LUT(8, uint8_t) break;
    }
}

}  // namespace

namespace py = pybind11;
using ptr = uintptr_t;  // a tensor's data_ptr()

// Each binding releases the GIL while its loop runs, as a ctypes call does.
#define BIND_DTYPE(SFX, T, S)                                                                  \
    m.def("sign_bits_" #SFX, [](ptr x, int64_t nb, int32_t odd, ptr out) {                     \
        ln_sign_bits_##SFX((const T*)x, nb, odd, (uint8_t*)out); }, nogil);                    \
    m.def("tb_lanes_" #SFX, [](ptr x, int64_t words, int32_t odd, int32_t bits, ptr out) {     \
        ln_tb_lanes_##SFX((const T*)x, words, odd, bits, (uint8_t*)out); }, nogil);            \
    m.def("quant_" #SFX, [](ptr x, int64_t nb, ptr scale, int32_t L, int32_t bits, ptr out) {  \
        ln_quant_##SFX((const T*)x, nb, (const S*)scale, L, bits, (void*)out); }, nogil);      \
    m.def("quant_stoch_" #SFX, [](ptr x, int64_t nb, ptr scale, ptr u, int32_t L, int32_t bits, \
                                  ptr out) {                                                   \
        ln_quant_stoch_##SFX((const T*)x, nb, (const S*)scale, (const S*)u, L, bits, (void*)out); }, nogil);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    const auto nogil = py::call_guard<py::gil_scoped_release>();
    BIND_DTYPE(f32, float, float)
    BIND_DTYPE(f64, double, double)
    BIND_DTYPE(bf16, uint16_t, float)
    m.def("majority", [](ptr r, int64_t P, int64_t c, int64_t thr, ptr out) {
        ln_majority((const uint8_t*)r, P, c, thr, (uint8_t*)out); }, nogil);
    m.def("unpack_sign", [](ptr wire, int64_t words, int32_t bits, int32_t mul, int64_t offset, ptr out) {
        ln_unpack_sign((const void*)wire, words, bits, mul, offset, (int8_t*)out); }, nogil);
}
