/* libnvidia-ml.so.1 for machines without a GPU: the NVML calls sae-dist makes (in the variants
 * nvidia-ml-py really resolves), answered from a scenario file, so the real bindings and the
 * product's code above them run unchanged. Compiled against NVIDIA's own nvml.h, so every
 * signature here is checked against the real API by the compiler.
 *
 * FAKE_NVML_SCENARIO names the scenario (see scenario.c). It is read again whenever the file
 * changes (inode, size or modification time), at the next call: a test rewrites the file to make
 * a GPU busy, lost or well again, with no clock involved. Without the variable, nvmlInit answers
 * DRIVER_NOT_LOADED, as on a machine with no driver. A bad scenario is one line on stderr and
 * NVML_ERROR_UNKNOWN from every call until the file is fixed.
 *
 * Built with -DFAKE_NVML_OLD_DRIVER it lacks the calls drivers before 510/525/565 lack
 * (nvmlDeviceGetMemoryInfo_v2, nvmlDeviceGetComputeRunningProcesses_v3, nvmlDeviceGetTemperatureV): the bindings then
 * raise FunctionNotFound, and the product's fallbacks run. */
#define NVML_NO_UNVERSIONED_FUNC_DEFS /* export nvmlInit and nvmlInit_v2 both, as the real one */
#include <nvml.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "scenario.h"

struct nvmlDevice_st {
    int index;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct nvmlDevice_st slots[FAKE_MAX_DEVICES];
static fake_scenario current, loading;
static int init_count;
static int loaded;      /* 1: `current` holds the file last seen; 0: that file was bad */
static int seen_valid;  /* `seen` describes the file last read (good or bad) */
static struct stat seen;

static void say(const char *path, const char *message) {
    fprintf(stderr, "fake NVML: %s: %s\n", path, message);
}

/* Read the scenario again if its file changed; NVML_SUCCESS when a good one is in place. */
static nvmlReturn_t refresh(void) {
    const char *path = getenv("FAKE_NVML_SCENARIO");
    if (!path || !*path) return NVML_ERROR_DRIVER_NOT_LOADED;
    struct stat now;
    if (stat(path, &now) != 0) {
        if (seen_valid || loaded) say(path, "cannot read the scenario file");
        seen_valid = 0, loaded = 0;
        return NVML_ERROR_UNKNOWN;
    }
    if (seen_valid && now.st_ino == seen.st_ino && now.st_dev == seen.st_dev && now.st_size == seen.st_size &&
        now.st_mtim.tv_sec == seen.st_mtim.tv_sec && now.st_mtim.tv_nsec == seen.st_mtim.tv_nsec)
        return loaded ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
    char error[300];
    seen = now, seen_valid = 1;
    if (scenario_load(path, &loading, error, sizeof error) != 0) {
        say(path, error);
        loaded = 0;
        return NVML_ERROR_UNKNOWN;
    }
    current = loading, loaded = 1;
    for (int i = 0; i < FAKE_MAX_DEVICES; i++) slots[i].index = i;
    return NVML_SUCCESS;
}

/* Every call but init: NVML started, and the scenario good. Returns with the lock held on success. */
static nvmlReturn_t enter(void) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t rc = init_count ? refresh() : NVML_ERROR_UNINITIALIZED;
    if (rc != NVML_SUCCESS) pthread_mutex_unlock(&lock);
    return rc;
}

static nvmlReturn_t leave(nvmlReturn_t rc) {
    pthread_mutex_unlock(&lock);
    return rc;
}

/* The device behind a handle, for `call`: NULL with `rc` set when the call must fail. */
static fake_device *device_for(nvmlDevice_t handle, enum fake_call call, nvmlReturn_t *rc) {
    struct nvmlDevice_st *slot = (struct nvmlDevice_st *)handle;
    if (slot < slots || slot >= slots + FAKE_MAX_DEVICES || slot->index >= current.count) {
        *rc = NVML_ERROR_INVALID_ARGUMENT;
        return NULL;
    }
    fake_device *d = &current.devices[slot->index];
    *rc = (nvmlReturn_t)d->errors[call];
    return *rc == NVML_SUCCESS ? d : NULL;
}

#define DEVICE_CALL(handle, call, d)                       \
    nvmlReturn_t rc = enter();                             \
    if (rc != NVML_SUCCESS) return rc;                     \
    fake_device *d = device_for((handle), (call), &rc);    \
    if (!d) return leave(rc);

static nvmlReturn_t copy_text(char *out, unsigned int length, const char *text) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, text);
    return NVML_SUCCESS;
}

/* ---- start and stop --------------------------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    nvmlReturn_t rc = refresh();
    if (rc == NVML_SUCCESS && current.init_error) rc = (nvmlReturn_t)current.init_error;
    if (rc == NVML_SUCCESS) init_count++;
    return leave(rc);
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    if (!init_count) return leave(NVML_ERROR_UNINITIALIZED);
    init_count--;
    return leave(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result) { return fake_error_string(result); }

/* ---- the system ------------------------------------------------------------------------- */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS) return rc;
    return leave(copy_text(version, length, current.driver_version));
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS) return rc;
    char text[100];
    snprintf(text, sizeof text, "12.%s", current.driver_version);
    return leave(copy_text(version, length, text));
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS) return rc;
    if (!cudaDriverVersion) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *cudaDriverVersion = 12040;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

/* ---- finding devices -------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS) return rc;
    if (!deviceCount) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *deviceCount = (unsigned)current.count; /* a lost GPU is still counted, as by the real driver */
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS) return rc;
    if (!device || index >= (unsigned)current.count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    /* A lost GPU fails here already: nvidia-smi's "Unable to determine the device handle". */
    rc = (nvmlReturn_t)current.devices[index].errors[CALL_HANDLE];
    if (rc == NVML_SUCCESS) *device = (nvmlDevice_t)&slots[index];
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS) return rc;
    if (!uuid || !device) return leave(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < current.count; i++) {
        if (strcmp(current.devices[i].uuid, uuid) == 0) {
            rc = (nvmlReturn_t)current.devices[i].errors[CALL_HANDLE];
            if (rc == NVML_SUCCESS) *device = (nvmlDevice_t)&slots[i];
            return leave(rc);
        }
    }
    return leave(NVML_ERROR_NOT_FOUND);
}

/* "domain:bus:device.function" (domain of 4 or 8 hex digits) or "bus:device.function", in
 * either case, as NVML accepts; 0 with the numbers, or -1. */
static int parse_bus_id(const char *text, unsigned *domain, unsigned *bus, unsigned *dev) {
    unsigned function;
    char end;
    if (sscanf(text, "%x:%x:%x.%x%c", domain, bus, dev, &function, &end) == 4) return 0;
    *domain = 0;
    return sscanf(text, "%x:%x.%x%c", bus, dev, &function, &end) == 3 ? 0 : -1;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS) return rc;
    unsigned domain, bus, dev;
    if (!pciBusId || !device || parse_bus_id(pciBusId, &domain, &bus, &dev) != 0)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < current.count; i++) {
        const fake_device *d = &current.devices[i];
        if (d->domain == domain && d->bus == bus && d->device == dev) {
            rc = (nvmlReturn_t)d->errors[CALL_HANDLE];
            if (rc == NVML_SUCCESS) *device = (nvmlDevice_t)&slots[i];
            return leave(rc);
        }
    }
    return leave(NVML_ERROR_NOT_FOUND);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* ---- identity --------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEVICE_CALL(device, CALL_UUID, d)
    return leave(copy_text(uuid, length, d->uuid));
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEVICE_CALL(device, CALL_NAME, d)
    return leave(copy_text(name, length, d->name));
}

static void fill_pci(const fake_device *d, nvmlPciInfo_t *pci) {
    memset(pci, 0, sizeof *pci);
    strcpy(pci->busIdLegacy, d->bus_id_legacy);
    strcpy(pci->busId, d->bus_id);
    pci->domain = d->domain, pci->bus = d->bus, pci->device = d->device;
    pci->pciDeviceId = d->pci_device_id;
    pci->pciSubSystemId = 0x147f10de;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEVICE_CALL(device, CALL_PCI, d)
    if (!pci) return leave(NVML_ERROR_INVALID_ARGUMENT);
    fill_pci(d, pci);
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

/* ---- readings --------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    DEVICE_CALL(device, CALL_MEMORY, d)
    if (!memory) return leave(NVML_ERROR_INVALID_ARGUMENT);
    memory->total = d->memory_total;
    memory->used = d->memory_used + d->memory_reserved; /* as real drivers: the reserved part counts as used */
    memory->free = d->memory_total - memory->used;
    return leave(NVML_SUCCESS);
}

#ifndef FAKE_NVML_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    DEVICE_CALL(device, CALL_MEMORY, d)
    if (!memory) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != nvmlMemory_v2) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory->total = d->memory_total;
    memory->reserved = d->memory_reserved;
    memory->used = d->memory_used;
    memory->free = d->memory_total - d->memory_used - d->memory_reserved;
    return leave(NVML_SUCCESS);
}
#endif

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    DEVICE_CALL(device, CALL_UTILIZATION, d)
    if (!utilization) return leave(NVML_ERROR_INVALID_ARGUMENT);
    utilization->gpu = d->utilization;
    utilization->memory = d->memory_utilization;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType, unsigned int *temp) {
    DEVICE_CALL(device, CALL_TEMPERATURE, d)
    if (!temp) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (sensorType != NVML_TEMPERATURE_GPU) return leave(NVML_ERROR_NOT_SUPPORTED);
    *temp = d->temperature;
    return leave(NVML_SUCCESS);
}

#ifndef FAKE_NVML_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature) {
    DEVICE_CALL(device, CALL_TEMPERATURE, d)
    if (!temperature) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (temperature->version != nvmlTemperature_v1) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (temperature->sensorType != NVML_TEMPERATURE_GPU) return leave(NVML_ERROR_NOT_SUPPORTED);
    temperature->temperature = (int)d->temperature;
    return leave(NVML_SUCCESS);
}
#endif

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    DEVICE_CALL(device, CALL_POWER, d)
    if (!power) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *power = d->power_mw;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    DEVICE_CALL(device, CALL_POWER_LIMIT, d)
    if (!limit) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *limit = d->power_limit_mw;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t device, unsigned int *currLinkGen) {
    DEVICE_CALL(device, CALL_PCIE, d)
    if (!currLinkGen) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *currLinkGen = d->pcie_gen;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t device, unsigned int *currLinkWidth) {
    DEVICE_CALL(device, CALL_PCIE, d)
    if (!currLinkWidth) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *currLinkWidth = d->pcie_width;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive) {
    DEVICE_CALL(device, CALL_NVLINK, d)
    if (!isActive || link >= (unsigned)d->link_count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *isActive = d->links[link] ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return leave(NVML_SUCCESS);
}

/* ---- processes -------------------------------------------------------------------------- */

/* NVML's two-call protocol: with too small a buffer, the count needed and INSUFFICIENT_SIZE. */
static nvmlReturn_t list_processes(nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos) {
    DEVICE_CALL(device, CALL_PROCESSES, d)
    if (!infoCount) return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned n = (unsigned)d->process_count;
    if (!infos || *infoCount < n) {
        *infoCount = n;
        return leave(n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned i = 0; i < n; i++)
        infos[i] = (nvmlProcessInfo_t){d->processes[i].pid, d->processes[i].used_memory, 0xFFFFFFFFu, 0xFFFFFFFFu};
    *infoCount = n;
    return leave(NVML_SUCCESS);
}

#ifndef FAKE_NVML_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    return list_processes(device, infoCount, infos);
}
#endif

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_v2_t *infos) {
    return list_processes(device, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp) {
    DEVICE_CALL(device, CALL_PROCESS_UTILIZATION, d)
    (void)lastSeenTimeStamp;
    if (!processSamplesCount) return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned n = (unsigned)d->process_count;
    if (n == 0) return leave(NVML_ERROR_NOT_FOUND); /* no sample since lastSeenTimeStamp */
    if (!utilization || *processSamplesCount < n) {
        *processSamplesCount = n;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned i = 0; i < n; i++)
        utilization[i] = (nvmlProcessUtilizationSample_t){d->processes[i].pid, 0, d->processes[i].sm_util, 0, 0, 0};
    *processSamplesCount = n;
    return leave(NVML_SUCCESS);
}
