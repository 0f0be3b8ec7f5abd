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
 *   FAKE_NVML_STATE  a file describing what changes over time, read again
 *                    on every call (tests rewrite it), one fact a line:
 *                      gpu I util U memutil M used_mib N power_mw P temp T
 *                      proc I PID USED_MIB SM_UTIL   (a compute process on GPU I)
 *                      xid I CODE                    (an XID event, delivered once)
 *                      ecc I COUNT                   (uncorrected volatile ECC errors)
 *                      lost I                        (GPU I fell off the bus)
 *                    Without it, utilisation is 10+I %, 512 MiB are used,
 *                    and there are no processes, events or errors.
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
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#include <unistd.h>

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

/* The facts of FAKE_NVML_STATE. */
struct gpu_state { int set; unsigned int util, memutil, power_mw, temp; unsigned long long used_mib, ecc; int lost; };
struct proc_state { unsigned int gpu, pid, sm; unsigned long long used_mib; };
/* Per thread: each call reads the file again into its own thread's copy,
 * so a sampler and an event waiter never see each other's half-read state. */
static __thread struct gpu_state gstate[64];
static __thread struct proc_state pstate[256];
static __thread int nprocs;
static __thread unsigned int xid_gpu[256], xid_code[256];
static __thread int nxids;

static void read_state(void) {
    memset(gstate, 0, sizeof gstate);
    nprocs = 0;
    nxids = 0;
    const char *path = getenv("FAKE_NVML_STATE");
    if (!path) return;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        /* A line being written (no newline yet) is not read: "xid 2 7" of
         * "xid 2 79" would be delivered as another error, and once. */
        if (!strchr(line, '\n')) break;
        unsigned int i, a, b, c, d, e;
        unsigned long long n;
        if (sscanf(line, "gpu %u util %u memutil %u used_mib %llu power_mw %u temp %u", &i, &a, &b, &n, &c, &d) == 6 && i < 64) {
            gstate[i].set = 1; gstate[i].util = a; gstate[i].memutil = b; gstate[i].used_mib = n;
            gstate[i].power_mw = c; gstate[i].temp = d;
        } else if (sscanf(line, "proc %u %u %llu %u", &i, &a, &n, &e) == 4 && i < 64 && nprocs < 256) {
            pstate[nprocs].gpu = i; pstate[nprocs].pid = a; pstate[nprocs].used_mib = n; pstate[nprocs].sm = e;
            nprocs++;
        } else if (sscanf(line, "xid %u %u", &i, &a) == 2 && i < 64 && nxids < 256) {
            xid_gpu[nxids] = i; xid_code[nxids] = a; nxids++;
        } else if (sscanf(line, "ecc %u %llu", &i, &n) == 2 && i < 64) {
            gstate[i].ecc = n;
        } else if (sscanf(line, "lost %u", &i) == 1 && i < 64) {
            gstate[i].lost = 1;
        }
    }
    fclose(f);
}

/* NVML_ERROR_GPU_IS_LOST for a GPU the state says fell off the bus. */
static int lost(unsigned int i) {
    read_state();
    return gstate[i].lost;
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
    initialised++; /* NVML counts its initialisations; each shutdown undoes one */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }

nvmlReturn_t nvmlShutdown(void) {
    if (initialised > 0) initialised--;
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
    if (d->mig < 0 && lost(d->index)) return NVML_ERROR_GPU_IS_LOST;
    m->total = mib * 1024ULL * 1024ULL;
    m->reserved = 0;
    m->used = (d->mig < 0 && gstate[d->index].set ? gstate[d->index].used_mib : 512ULL) * 1024ULL * 1024ULL;
    if (m->used > m->total) m->used = m->total;
    m->free = m->total - m->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !u) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(d->index)) return NVML_ERROR_GPU_IS_LOST;
    u->gpu = gstate[d->index].set ? gstate[d->index].util : 10 + d->index;
    u->memory = gstate[d->index].set ? gstate[d->index].memutil : 5;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *mw) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !mw) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(d->index)) return NVML_ERROR_GPU_IS_LOST;
    *mw = gstate[d->index].set ? gstate[d->index].power_mw : 70000;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned int *t) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !t || sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(d->index)) return NVML_ERROR_GPU_IS_LOST;
    *t = gstate[d->index].set ? gstate[d->index].temp : 35;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int type, int counter, unsigned long long *n) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !n) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(d->index)) return NVML_ERROR_GPU_IS_LOST;
    /* type 1: uncorrected; counter 0: volatile. */
    *n = (type == 1 && counter == 0) ? gstate[d->index].ecc : 0;
    return NVML_SUCCESS;
}

typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *out) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !count) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(d->index)) return NVML_ERROR_GPU_IS_LOST;
    unsigned int n = 0;
    for (int k = 0; k < nprocs; k++) if (pstate[k].gpu == d->index && d->mig < 0) n++;
    if (!out || *count < n) { *count = n; return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS; }
    unsigned int j = 0;
    for (int k = 0; k < nprocs; k++) {
        if (pstate[k].gpu != d->index || d->mig >= 0) continue;
        out[j].pid = pstate[k].pid;
        out[j].usedGpuMemory = pstate[k].used_mib * 1024ULL * 1024ULL;
        out[j].gpuInstanceId = out[j].computeInstanceId = 0xFFFFFFFFu;
        j++;
    }
    *count = j;
    return NVML_SUCCESS;
}

typedef struct { unsigned int pid; unsigned long long timeStamp; unsigned int smUtil, memUtil, encUtil, decUtil; } nvmlProcessUtilizationSample_t;

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *out, unsigned int *count, unsigned long long since) {
    (void)since;
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !count) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(d->index)) return NVML_ERROR_GPU_IS_LOST;
    unsigned int n = 0;
    for (int k = 0; k < nprocs; k++) if (pstate[k].gpu == d->index) n++;
    if (!out || *count < n) { *count = n; return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS; }
    unsigned int j = 0;
    for (int k = 0; k < nprocs; k++) {
        if (pstate[k].gpu != d->index) continue;
        out[j].pid = pstate[k].pid;
        out[j].timeStamp = 1;
        out[j].smUtil = pstate[k].sm;
        out[j].memUtil = out[j].encUtil = out[j].decUtil = 0;
        j++;
    }
    *count = j;
    return NVML_SUCCESS;
}

/* Events: each set delivers the XID lines written after it was made, once each. */
typedef struct { nvmlDevice_t device; unsigned long long eventType, eventData; unsigned int gpuInstanceId, computeInstanceId; } nvmlEventData_t;
static int sets[64];
static int nsets;

nvmlReturn_t nvmlEventSetCreate(void **set) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!set || nsets >= 64) return NVML_ERROR_INVALID_ARGUMENT;
    /* FAKE_NVML_EVENTSET_DELAY_MS: a slow start of the watcher, as on a
     * loaded machine (events before the set exists are never delivered). */
    const char *delay = getenv("FAKE_NVML_EVENTSET_DELAY_MS");
    if (delay) usleep((useconds_t)atoi(delay) * 1000);
    read_state();
    sets[nsets] = nxids;
    *set = &sets[nsets++];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetFree(void *set) { (void)set; return NVML_SUCCESS; }

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !types) return NVML_ERROR_INVALID_ARGUMENT;
    *types = 0x1 | 0x2 | 0x8; /* single- and double-bit ECC, critical XID */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, void *set) {
    (void)types;
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !set) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetWait_v2(void *set, nvmlEventData_t *data, unsigned int timeout_ms) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int waited = 0;; waited += 50) {
        read_state();
        int *delivered = (int *)set;
        if (*delivered < nxids) {
            int k = (*delivered)++;
            data->device = &devices[xid_gpu[k]];
            data->eventType = 0x8;
            data->eventData = xid_code[k];
            data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
            return NVML_SUCCESS;
        }
        if (waited >= timeout_ms) return NVML_ERROR_TIMEOUT;
        usleep(50000);
    }
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

/* A MIG device's GPU instance id (its instance number + 1) and compute
 * instance id (0); not a MIG device: invalid argument, as NVML answers. */
nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t d, unsigned int *id) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !id || d->mig < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *id = (unsigned int)d->mig + 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t d, unsigned int *id) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || !id || d->mig < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *id = 0;
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
