"""Native CPU kernels: the wire kernels of comm.kernels as plain C loops, built once per host with
the system C compiler and called through ctypes.

They are the CPU's fast implementation (what `comm.kernels=auto` runs on CPU, beside the eager
torch reference): the same bytes (checked against the reference in warm-up and by the tests), no
Python compiler stack in the training process (inductor's imports and compiled code cost RSS per
process whatever the model size: docs/fast_path.md), and one small build per host instead of a
compile per kernel.

Kernels (each one pass over its input, no temporary):
    sign_bits      tb(x, step) flags -> packed bits              (== comm.vote.tb_packed's bytes)
    majority       P packed chunks -> packed majority with tie break (== comm.vote.local_majority)
    quant_blocks   Lion Cub eq. 1 of whole QBLOCK blocks, nearest or stochastic rounding, straight
                   into `bits`-wide lanes (== comm.kernels._k_quant_blocks / _k_quant_blocks_stoch)
    tb_lanes       the levels == 0 wire (== comm.kernels._k_tb_lanes)
    unpack_sign    summed wire -> int8 sign of the sum over P ranks (== sign(unpack_sum_reference))

Exactness: the float steps are the reference's, in its order and precision (x converted to the
scale's dtype, one multiply, round half to even or floor + compare, clamp), compiled with
-ffp-contract=off so no multiply and subtract fuse into an fma, and without -ffast-math. A NaN
y converts to the int8 q the reference's float -> int8 conversion gives (0: through int32, where
x86's cvttps2dq gives INT32_MIN, whose low byte is 0); an inf in a tensor makes its scale 0 and
that element's y NaN, so this is reached by an overflowing gradient (tested).

The library is built with -O3 -march=native into a cache directory keyed by the source, the
compiler, its flags and the host's CPU flags (LIONCUB_NATIVE_CACHE, default
<tempdir>/lioncub_native_<uid>), atomically, so concurrent ranks build it at most once each and
never load a half-written file. The build records the library's sha256 beside it (`<file>.sha256`,
renamed into place before the library); every load first checks the file against it, and a file
that differs (truncated: mapping it would end the process with SIGBUS; altered; or from a version
that recorded nothing) is named in a warning, removed and rebuilt, never loaded.
LIONCUB_NO_COMPILE=1 turns them off with the compiled kernels.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

import torch

CACHE_ENV = "LIONCUB_NATIVE_CACHE"
NO_COMPILE_ENV = "LIONCUB_NO_COMPILE"  # comm.kernels.NO_COMPILE_ENV: no kernel is built
QBLOCK = 1024  # elements per quantizer block, comm.kernels.QBLOCK's one definition (SOURCE's #define is made from it)
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-std=c11"]

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

#define QBLOCK @QBLOCK@

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
""".replace("@QBLOCK@", str(QBLOCK))

_lib: ctypes.CDLL | None = None
_why: str | None = None
_loaded = False


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    for c in ("cc", "gcc", "clang"):
        path = shutil.which(c)
        if path:
            return path
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _private_dir(d: str) -> str:
    """d, created with mode 0700 if missing, refused unless this user owns it and nobody else may
    write to it: a library is loaded from it, so another local user must not be able to plant one."""
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        raise RuntimeError(f"the native kernels' cache {d} is owned by uid {st.st_uid} or writable by others "
                           f"(mode {oct(st.st_mode & 0o777)}); remove it or set {CACHE_ENV} to a directory of "
                           f"your own")
    return d


def cache_dir() -> str:
    """Where the library is built: $LIONCUB_NATIVE_CACHE, else one directory per user in the temp dir."""
    user = os.getuid() if hasattr(os, "getuid") else 0
    return os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(), f"lioncub_native_{user}")


def _located() -> tuple[str, str]:
    """(compiler, path of the cached library for this source, compiler and CPU); nothing is built."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (CC, cc, gcc, clang)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, errors="replace").stdout
    key = hashlib.sha256("\0".join([SOURCE, cc, version, " ".join(FLAGS), platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:20]
    return cc, os.path.join(cache_dir(), f"lioncub_native_{key}.so")


def library_path() -> str:
    """The file the native kernels are (or would be) loaded from here ("" without a compiler)."""
    try:
        return _located()[1]
    except (RuntimeError, OSError):
        return ""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verified(so: str) -> bool:
    """Whether `so` exists and matches the sha256 recorded beside it (`<so>.sha256`) when it was
    built. A damaged one (a truncated file kills the process that maps it with SIGBUS; an altered
    one runs other code) is named in a warning and removed, to be rebuilt."""
    if not os.path.exists(so):
        return False
    try:
        with open(so + ".sha256") as f:
            recorded = f.read().strip()
        ok = recorded == _sha256(so)
    except OSError:
        ok = False
    if not ok:
        warnings.warn(f"native kernels: {so} does not match the sha256 recorded when it was built (truncated, "
                      f"altered, or built by an older version); rebuilding it", stacklevel=4)
        for path in (so, so + ".sha256"):
            if os.path.exists(path):
                os.unlink(path)
    return ok


def _build() -> ctypes.CDLL:
    cc, so = _located()
    d = _private_dir(cache_dir())
    if not _verified(so):
        fd, src = tempfile.mkstemp(suffix=".c", dir=d)
        with os.fdopen(fd, "w") as f:
            f.write(SOURCE)
        fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=d)  # unique even across PID namespaces
        os.close(fd)
        try:
            done = subprocess.run([cc, *FLAGS, src, "-o", tmp, "-lm"], capture_output=True, text=True,
                                  errors="replace")
            if done.returncode != 0:
                raise RuntimeError(f"building the native kernels with {cc} failed:\n{done.stderr[-2000:]}")
            digest = _sha256(tmp)
            fd, tmp_sum = tempfile.mkstemp(suffix=".sha256.tmp", dir=d)
            with os.fdopen(fd, "w") as f:
                f.write(digest)
            os.replace(tmp_sum, so + ".sha256")  # recorded before the library appears under its name
            os.replace(tmp, so)  # atomic: a concurrent rank loads a whole file or builds its own
        finally:
            for path in (src, tmp):
                if os.path.exists(path):
                    os.unlink(path)
    lib = ctypes.CDLL(so)
    i64, i32, vp = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    for t in ("f32", "f64", "bf16"):
        getattr(lib, f"ln_sign_bits_{t}").argtypes = [vp, i64, i32, vp]
        getattr(lib, f"ln_tb_lanes_{t}").argtypes = [vp, i64, i32, i32, vp]
        getattr(lib, f"ln_quant_{t}").argtypes = [vp, i64, vp, i32, i32, vp]
        getattr(lib, f"ln_quant_stoch_{t}").argtypes = [vp, i64, vp, vp, i32, i32, vp]
    lib.ln_majority.argtypes = [vp, i64, i64, i64, vp]
    lib.ln_unpack_sign.argtypes = [vp, i64, i32, i32, i64, vp]
    return lib


def unavailable(device: torch.device | str = "cpu") -> str | None:
    """Why the native kernels cannot run on `device` here, or None when they can (built and loaded
    on the first call)."""
    global _lib, _why, _loaded
    if torch.device(device).type != "cpu":
        return f"native kernels run on the CPU only, not on {torch.device(device).type}"
    if os.environ.get(NO_COMPILE_ENV, "0") not in ("", "0"):  # builds nothing, as for inductor
        return f"{NO_COMPILE_ENV}={os.environ[NO_COMPILE_ENV]} is set"
    if not _loaded:
        _loaded = True
        try:
            _lib = _build()
        except Exception as e:  # any failure is a reason, never a silent "available" with no library
            _why = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
    return _why


def _need() -> ctypes.CDLL:
    why = unavailable("cpu")
    if why is not None:
        raise RuntimeError(f"native kernels: {why}; use comm.kernels=eager or compiled")
    return _lib


_SUFFIX = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}


def supports(x: torch.Tensor) -> bool:
    """Whether the native kernels take x's dtype (float32, float64, bfloat16) on its device."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX


def _ptr(t: torch.Tensor) -> int:
    if not t.is_contiguous():
        raise ValueError("native kernels: tensors must be contiguous")
    return t.data_ptr()


def sign_bits(x: torch.Tensor, odd: bool, out: torch.Tensor) -> None:
    """out[j] (uint8) = packed tb flags of x[8j:8j+8], for j < out.numel() (x holds 8 per byte)."""
    _need()
    getattr(_lib, f"ln_sign_bits_{_SUFFIX[x.dtype]}")(_ptr(x), out.numel(), int(odd), _ptr(out))


def tb_lanes(x: torch.Tensor, odd: bool, bits: int, out: torch.Tensor) -> None:
    """out[w] = the levels == 0 lanes of x[w*per:(w+1)*per] (per = 8 // bits), bits in 1, 2, 4, 8."""
    _need()
    getattr(_lib, f"ln_tb_lanes_{_SUFFIX[x.dtype]}")(_ptr(x), out.numel(), int(odd), bits, _ptr(out))


def majority(recv: torch.Tensor, P: int, thr: int, out: torch.Tensor) -> None:
    """out[c] = majority bits over the P rows of recv (uint8[P * c]) with threshold thr."""
    _need()
    _lib.ln_majority(_ptr(recv), P, out.numel(), thr, _ptr(out))


def quant_blocks(x: torch.Tensor, scale: torch.Tensor, levels: int, bits: int, out: torch.Tensor,
                 u: torch.Tensor | None = None) -> None:
    """Lion Cub eq. 1 of x's whole QBLOCK blocks (block b with scale[b], float64 for float64 x,
    else float32) into `bits`-wide lanes of out; u: the uniforms of stochastic rounding (one per
    element, the scale's dtype), None for round half to even."""
    _need()
    nb = x.numel() // QBLOCK
    sfx = _SUFFIX[x.dtype]
    if u is None:
        getattr(_lib, f"ln_quant_{sfx}")(_ptr(x), nb, _ptr(scale), levels, bits, _ptr(out))
    else:
        getattr(_lib, f"ln_quant_stoch_{sfx}")(_ptr(x), nb, _ptr(scale), _ptr(u), levels, bits, _ptr(out))


def unpack_sign(wire: torch.Tensor, bits: int, mul: int, offset: int, out: torch.Tensor) -> None:
    """out (int8) = sign(mul * lane - offset) of every lane of wire's whole words (uint8, or int32
    words of two 16-bit lanes)."""
    _need()
    _lib.ln_unpack_sign(_ptr(wire), wire.numel(), bits, mul, offset, _ptr(out))


__all__ = ["CACHE_ENV", "cache_dir", "library_path", "majority", "quant_blocks", "sign_bits", "supports",
           "tb_lanes", "unavailable", "unpack_sign"]
