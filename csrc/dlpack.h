/* The DLPack structures gvr consumes, written from the DLPack specification (v1.x ABI).
 * Only what a consumer needs: device and dtype codes, DLTensor, and both managed-tensor forms
 * (legacy "dltensor" capsules carry DLManagedTensor, "dltensor_versioned" capsules carry
 * DLManagedTensorVersioned). Layouts must match the specification exactly. */
#ifndef GVR_DLPACK_H
#define GVR_DLPACK_H

#include <stdint.h>

enum {
    GVR_DL_CPU = 1,
    GVR_DL_CUDA = 2,
    GVR_DL_CUDA_HOST = 3, /* pinned host memory: readable by the CPU */
    GVR_DL_CUDA_MANAGED = 13,
};

enum { GVR_DL_INT = 0, GVR_DL_UINT = 1, GVR_DL_FLOAT = 2, GVR_DL_BFLOAT = 4, GVR_DL_FLOAT8_E4M3FN = 10 };

typedef struct {
    int32_t device_type;
    int32_t device_id;
} gvr_DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} gvr_DLDataType;

typedef struct {
    void *data;
    gvr_DLDevice device;
    int32_t ndim;
    gvr_DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} gvr_DLTensor;

typedef struct gvr_DLManagedTensor {
    gvr_DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct gvr_DLManagedTensor *self);
} gvr_DLManagedTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} gvr_DLPackVersion;

#define GVR_DLPACK_FLAG_READ_ONLY ((uint64_t)1 << 0)
#define GVR_DLPACK_FLAG_IS_COPIED ((uint64_t)1 << 1)

typedef struct gvr_DLManagedTensorVersioned {
    gvr_DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct gvr_DLManagedTensorVersioned *self);
    uint64_t flags;
    gvr_DLTensor dl_tensor;
} gvr_DLManagedTensorVersioned;

#endif
