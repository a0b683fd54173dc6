/*
 * A stand-in for the NVIDIA driver library (libcuda.so.1) on machines WITHOUT a GPU driver.
 *
 * Purpose: cuDNN's runtime-compiled engine library links libcuda.so.1, so without a driver cuDNN
 * cannot even load it, and its "deviceless" planning mode (a JSON device descriptor instead of a
 * GPU) is unreachable. With this stub loaded first (RTLD_GLOBAL, soname libcuda.so.1) cuDNN loads
 * its engines and answers support questions from its own heuristics.
 *
 * Contract: every entry point reports CUDA_ERROR_NO_DEVICE (100), writes "nothing" (0 / NULL)
 * through its output pointers, and never touches a device. It can launch nothing.
 *
 * The symbol set is what cuDNN 9.28 needs on the deviceless planning path:
 *   - the undefined symbols of libcudnn_engines_runtime_compiled.so.9 (nm -D --undefined-only);
 *   - the symbols cuDNN resolves with dlsym() at plan time (it logs "Could not load symbol X"
 *     for each one that is missing and then declines every engine);
 *   - cuInit / cuDriverGetVersion / cuDeviceGetCount / cuGetProcAddress, which the statically
 *     linked CUDA runtime inside cuDNN queries first.
 * te_fl_attention/probes/fused/stubcuda.py builds this file and must never load it when a real driver
 * is loadable. Written for te_fl_attention; not derived from NVIDIA headers.
 */

#include <stddef.h>

typedef int stub_result;          /* CUresult */
typedef int stub_device;          /* CUdevice */
typedef void *stub_handle;        /* CUcontext, CUmodule, CUfunction, ... */

#define STUB_NO_DEVICE 100        /* CUDA_ERROR_NO_DEVICE */
#define STUB_EXPORT __attribute__((visibility("default")))

/* Marker: lets stubcuda.real_driver_status() tell this stub from a real driver. */
STUB_EXPORT const int te_fl_attention_stub = 1;

static const char stub_error_name[] = "CUDA_ERROR_NO_DEVICE";
static const char stub_error_text[] =
    "no CUDA-capable device is detected (te_fl_attention stub driver: this machine has no GPU)";

/* ---- initialization and version queries ------------------------------------------------- */

STUB_EXPORT stub_result cuInit(unsigned int flags) {
    (void)flags;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuDriverGetVersion(int *version) {
    if (version) *version = 0;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuDeviceGetCount(int *count) {
    if (count) *count = 0;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuDeviceGet(stub_device *device, int ordinal) {
    (void)ordinal;
    if (device) *device = 0;
    return STUB_NO_DEVICE;
}

/* The runtime asks the driver for entry points by name; the stub has none to give. */
STUB_EXPORT stub_result cuGetProcAddress(const char *symbol, void **fn, int cuda_version,
                                         unsigned long long flags) {
    (void)symbol; (void)cuda_version; (void)flags;
    if (fn) *fn = NULL;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuGetProcAddress_v2(const char *symbol, void **fn, int cuda_version,
                                            unsigned long long flags, int *symbol_status) {
    (void)symbol; (void)cuda_version; (void)flags;
    if (fn) *fn = NULL;
    if (symbol_status) *symbol_status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return STUB_NO_DEVICE;
}

/* Error strings: give a readable text so that cuDNN's own messages stay meaningful. */
STUB_EXPORT stub_result cuGetErrorString(stub_result error, const char **text) {
    (void)error;
    if (text) *text = stub_error_text;
    return 0;
}

STUB_EXPORT stub_result cuGetErrorName(stub_result error, const char **name) {
    (void)error;
    if (name) *name = stub_error_name;
    return 0;
}

/* ---- contexts and streams ---------------------------------------------------------------- */

STUB_EXPORT stub_result cuCtxGetCurrent(stub_handle *ctx) {
    if (ctx) *ctx = NULL;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuCtxPushCurrent(stub_handle ctx) {
    (void)ctx;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuCtxPushCurrent_v2(stub_handle ctx) {
    (void)ctx;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuCtxPopCurrent(stub_handle *ctx) {
    if (ctx) *ctx = NULL;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuCtxPopCurrent_v2(stub_handle *ctx) {
    if (ctx) *ctx = NULL;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuCtxGetLimit(size_t *value, int limit) {
    (void)limit;
    if (value) *value = 0;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuStreamGetCtx(stub_handle stream, stub_handle *ctx) {
    (void)stream;
    if (ctx) *ctx = NULL;
    return STUB_NO_DEVICE;
}

/* ---- modules, libraries, kernels --------------------------------------------------------- */

STUB_EXPORT stub_result cuModuleLoadData(stub_handle *module, const void *image) {
    (void)image;
    if (module) *module = NULL;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuModuleUnload(stub_handle module) {
    (void)module;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuModuleGetFunction(stub_handle *fn, stub_handle module, const char *name) {
    (void)module; (void)name;
    if (fn) *fn = NULL;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuLibraryLoadData(stub_handle *library, const void *code, void *jit_opts,
                                          void *jit_vals, unsigned int n_jit, void *lib_opts,
                                          void *lib_vals, unsigned int n_lib) {
    (void)code; (void)jit_opts; (void)jit_vals; (void)n_jit;
    (void)lib_opts; (void)lib_vals; (void)n_lib;
    if (library) *library = NULL;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuLibraryLoadFromFile(stub_handle *library, const char *path,
                                              void *jit_opts, void *jit_vals, unsigned int n_jit,
                                              void *lib_opts, void *lib_vals, unsigned int n_lib) {
    (void)path; (void)jit_opts; (void)jit_vals; (void)n_jit;
    (void)lib_opts; (void)lib_vals; (void)n_lib;
    if (library) *library = NULL;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuLibraryUnload(stub_handle library) {
    (void)library;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuLibraryGetKernel(stub_handle *kernel, stub_handle library,
                                           const char *name) {
    (void)library; (void)name;
    if (kernel) *kernel = NULL;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuKernelGetFunction(stub_handle *fn, stub_handle kernel) {
    (void)kernel;
    if (fn) *fn = NULL;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuKernelGetAttribute(int *value, int attribute, stub_handle kernel,
                                             stub_device device) {
    (void)attribute; (void)kernel; (void)device;
    if (value) *value = 0;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuKernelSetAttribute(int attribute, int value, stub_handle kernel,
                                             stub_device device) {
    (void)attribute; (void)value; (void)kernel; (void)device;
    return STUB_NO_DEVICE;
}

/* ---- JIT linking ------------------------------------------------------------------------- */

STUB_EXPORT stub_result cuLinkCreate(unsigned int n_opts, void *opts, void **vals,
                                     stub_handle *state) {
    (void)n_opts; (void)opts; (void)vals;
    if (state) *state = NULL;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuLinkCreate_v2(unsigned int n_opts, void *opts, void **vals,
                                        stub_handle *state) {
    return cuLinkCreate(n_opts, opts, vals, state);
}

STUB_EXPORT stub_result cuLinkAddData(stub_handle state, int type, void *data, size_t size,
                                      const char *name, unsigned int n_opts, void *opts,
                                      void **vals) {
    (void)state; (void)type; (void)data; (void)size; (void)name;
    (void)n_opts; (void)opts; (void)vals;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuLinkAddData_v2(stub_handle state, int type, void *data, size_t size,
                                         const char *name, unsigned int n_opts, void *opts,
                                         void **vals) {
    return cuLinkAddData(state, type, data, size, name, n_opts, opts, vals);
}

STUB_EXPORT stub_result cuLinkComplete(stub_handle state, void **cubin, size_t *size) {
    (void)state;
    if (cubin) *cubin = NULL;
    if (size) *size = 0;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuLinkDestroy(stub_handle state) {
    (void)state;
    return STUB_NO_DEVICE;
}

/* ---- launches and occupancy (never reached on the deviceless path; present for loading) -- */

STUB_EXPORT stub_result cuLaunchKernel(stub_handle fn, unsigned int gx, unsigned int gy,
                                       unsigned int gz, unsigned int bx, unsigned int by,
                                       unsigned int bz, unsigned int smem, stub_handle stream,
                                       void **params, void **extra) {
    (void)fn; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz;
    (void)smem; (void)stream; (void)params; (void)extra;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuLaunchKernelEx(const void *config, stub_handle fn, void **params,
                                         void **extra) {
    (void)config; (void)fn; (void)params; (void)extra;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuLaunchCooperativeKernel(stub_handle fn, unsigned int gx,
                                                  unsigned int gy, unsigned int gz,
                                                  unsigned int bx, unsigned int by,
                                                  unsigned int bz, unsigned int smem,
                                                  stub_handle stream, void **params) {
    (void)fn; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz;
    (void)smem; (void)stream; (void)params;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuOccupancyMaxPotentialClusterSize(int *size, stub_handle fn,
                                                           const void *config) {
    (void)fn; (void)config;
    if (size) *size = 0;
    return STUB_NO_DEVICE;
}

/* ---- tensor-map (TMA) descriptors -------------------------------------------------------- */

STUB_EXPORT stub_result cuTensorMapEncodeTiled(void *map, int dtype, unsigned int rank,
                                               void *addr, const void *dims, const void *strides,
                                               const void *box, const void *elem_strides,
                                               int interleave, int swizzle, int l2_promotion,
                                               int oob_fill) {
    (void)map; (void)dtype; (void)rank; (void)addr; (void)dims; (void)strides; (void)box;
    (void)elem_strides; (void)interleave; (void)swizzle; (void)l2_promotion; (void)oob_fill;
    return STUB_NO_DEVICE;
}

STUB_EXPORT stub_result cuTensorMapEncodeIm2col(void *map, int dtype, unsigned int rank,
                                                void *addr, const void *dims,
                                                const void *strides, const int *lower,
                                                const int *upper, unsigned int channels,
                                                unsigned int pixels, const void *elem_strides,
                                                int interleave, int swizzle, int l2_promotion,
                                                int oob_fill) {
    (void)map; (void)dtype; (void)rank; (void)addr; (void)dims; (void)strides; (void)lower;
    (void)upper; (void)channels; (void)pixels; (void)elem_strides; (void)interleave;
    (void)swizzle; (void)l2_promotion; (void)oob_fill;
    return STUB_NO_DEVICE;
}
