/*
 * A small stand-in for NVIDIA's libnvidia-ml.so.1, for tests on machines
 * without a GPU. It implements the few NVML calls gpuflow's agent makes,
 * with the C signatures of nvml.h, and reports GPUs described by the
 * environment:
 *   FAKE_NVML_GPUS   number of GPUs (default 2)
 *   FAKE_NVML_MODEL  product name (default "NVIDIA H100 80GB HBM3")
 *   FAKE_NVML_MEM_MIB memory per GPU in MiB (default 81559)
 *   FAKE_NVML_FAIL_INIT  when set, nvmlInit_v2 fails (driver not loaded)
 *   FAKE_NVML_MIG    when set, GPUs are in MIG mode with these instances,
 *                    comma-separated profiles (e.g. "1g.10gb,1g.10gb,3g.40gb")
 *   FAKE_NVML_MIG_GPUS  how many GPUs (the first ones) FAKE_NVML_MIG applies
 *                    to (default all)
 *   FAKE_NVML_NVLINK NVLink islands, GPU indices joined by '-', islands by
 *                    ',' (e.g. "0-1,2-3"); GPUs of one island reach each
 *                    other over NVLink. Default: none (PCIe only)
 *   FAKE_NVML_NUMA   NUMA node per GPU, comma-separated (e.g. "0,0,1,1")
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9

/* mig < 0: the physical GPU; else its MIG instance number. */
typedef struct fake_device { unsigned int index; int mig; } *nvmlDevice_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;

static struct fake_device devices[64];
static struct fake_device mig_devices[64][7];

/* Whether GPU i is in MIG mode. */
static int in_mig(unsigned int i) {
    const char *s = getenv("FAKE_NVML_MIG");
    const char *n = getenv("FAKE_NVML_MIG_GPUS");
    return s && *s && (!n || i < (unsigned int)atoi(n));
}

/* The k-th profile of FAKE_NVML_MIG into out (NUL-terminated); 0 if none. */
static int mig_profile(int k, char *out, size_t len) {
    const char *s = getenv("FAKE_NVML_MIG");
    if (!s || !*s) return 0;
    for (int i = 0; *s; i++) {
        const char *end = strchr(s, ',');
        size_t n = end ? (size_t)(end - s) : strlen(s);
        if (i == k) {
            if (n + 1 > len) n = len - 1;
            memcpy(out, s, n);
            out[n] = 0;
            return 1;
        }
        if (!end) break;
        s = end + 1;
    }
    return 0;
}
static int initialised = 0;

static unsigned int count(void) {
    const char *s = getenv("FAKE_NVML_GPUS");
    int n = s ? atoi(s) : 2;
    if (n < 0) n = 0;
    if (n > 64) n = 64;
    return (unsigned int)n;
}

nvmlReturn_t nvmlInit_v2(void) {
    if (getenv("FAKE_NVML_FAIL_INIT")) return NVML_ERROR_DRIVER_NOT_LOADED;
    for (unsigned int i = 0; i < 64; i++) {
        devices[i].index = i;
        devices[i].mig = -1;
        for (int k = 0; k < 7; k++) {
            mig_devices[i][k].index = i;
            mig_devices[i][k].mig = k;
        }
    }
    initialised = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }

nvmlReturn_t nvmlShutdown(void) {
    initialised = 0;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) { return r == 0 ? "Success" : "Fake NVML error"; }

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (length < 12) return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(version, length, "550.54.15");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!n) return NVML_ERROR_INVALID_ARGUMENT;
    *n = count();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || i >= count()) return NVML_ERROR_INVALID_ARGUMENT;
    *d = &devices[i];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !name) return NVML_ERROR_INVALID_ARGUMENT;
    const char *m = getenv("FAKE_NVML_MODEL");
    if (!m) m = "NVIDIA H100 80GB HBM3";
    char profile[32];
    if (d->mig >= 0 && mig_profile(d->mig, profile, sizeof profile)) {
        if ((unsigned int)snprintf(name, length, "%s MIG %s", m, profile) >= length)
            return NVML_ERROR_INSUFFICIENT_SIZE;
        return NVML_SUCCESS;
    }
    if (strlen(m) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(name, m);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !uuid) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < 41) return NVML_ERROR_INSUFFICIENT_SIZE;
    if (d->mig >= 0)
        snprintf(uuid, length, "MIG-fa4e0000-0000-0000-%04u-%012d", d->index, d->mig);
    else
        snprintf(uuid, length, "GPU-fa4e0000-0000-0000-0000-%012u", d->index);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !m) return NVML_ERROR_INVALID_ARGUMENT;
    const char *s = getenv("FAKE_NVML_MEM_MIB");
    unsigned long long mib = s ? strtoull(s, 0, 10) : 81559ULL;
    char profile[32];
    if (d->mig >= 0 && mig_profile(d->mig, profile, sizeof profile)) {
        const char *dot = strchr(profile, '.');
        mib = dot ? strtoull(dot + 1, 0, 10) * 1024ULL : 0;
    }
    m->total = mib * 1024ULL * 1024ULL;
    m->reserved = 0;
    m->used = 512ULL * 1024ULL * 1024ULL;
    m->free = m->total - m->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !u) return NVML_ERROR_INVALID_ARGUMENT;
    u->gpu = 10 + d->index;
    u->memory = 5;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = in_mig(d->index) ? 1 : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *n) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !n) return NVML_ERROR_INVALID_ARGUMENT;
    *n = in_mig(d->index) ? 7 : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int k, nvmlDevice_t *out) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !out || d->mig >= 0 || k >= 7) return NVML_ERROR_INVALID_ARGUMENT;
    char profile[32];
    if (!in_mig(d->index) || !mig_profile((int)k, profile, sizeof profile)) return NVML_ERROR_NOT_FOUND;
    *out = &mig_devices[d->index][k];
    return NVML_SUCCESS;
}

/* The island of GPU i in FAKE_NVML_NVLINK (its position), or -1. */
static int island(unsigned int i) {
    const char *s = getenv("FAKE_NVML_NVLINK");
    if (!s) return -1;
    int k = 0;
    while (*s) {
        char *end;
        unsigned long g = strtoul(s, &end, 10);
        if (end == s) return -1;
        if (g == i) return k;
        s = end;
        if (*s == ',') k++;
        if (*s) s++;
    }
    return -1;
}

#define NVML_P2P_CAPS_INDEX_NVLINK 2
#define NVML_P2P_STATUS_OK 0
#define NVML_P2P_STATUS_NOT_SUPPORTED 5

nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t a, nvmlDevice_t b, int index, int *status) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!a || !b || !status) return NVML_ERROR_INVALID_ARGUMENT;
    int ia = island(a->index), ib = island(b->index);
    *status = (index == NVML_P2P_CAPS_INDEX_NVLINK && ia >= 0 && ia == ib && a->index != b->index)
        ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t d, unsigned int *node) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !node) return NVML_ERROR_INVALID_ARGUMENT;
    const char *s = getenv("FAKE_NVML_NUMA");
    if (!s) return 3; /* NVML_ERROR_NOT_SUPPORTED */
    for (unsigned int i = 0; *s; i++) {
        char *end;
        unsigned long n = strtoul(s, &end, 10);
        if (end == s) break;
        if (i == d->index) { *node = (unsigned int)n; return NVML_SUCCESS; }
        s = *end ? end + 1 : end;
    }
    return 3;
}
