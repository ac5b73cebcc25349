/* What the emulated driver knows: the devices of a scenario file, checked once when read. */
#ifndef FAKE_NVML_SCENARIO_H
#define FAKE_NVML_SCENARIO_H

#define FAKE_MAX_DEVICES 64
#define FAKE_MAX_PROCESSES 64
#define FAKE_MAX_LINKS 18 /* NVML_NVLINK_MAX_LINKS */
#define FAKE_TEXT 96

/* The calls an error can be injected into, by the names a scenario's "errors" uses. */
enum fake_call {
    CALL_HANDLE, CALL_UUID, CALL_NAME, CALL_MEMORY, CALL_UTILIZATION, CALL_TEMPERATURE, CALL_POWER,
    CALL_POWER_LIMIT, CALL_PROCESSES, CALL_PCI, CALL_NVLINK, CALL_PCIE, CALL_PROCESS_UTILIZATION,
    CALL_COUNT
};

typedef struct {
    unsigned pid;
    unsigned long long used_memory; /* NVML_VALUE_NOT_AVAILABLE when the scenario says null */
    unsigned sm_util;
} fake_process;

typedef struct {
    char name[FAKE_TEXT], uuid[FAKE_TEXT], bus_id[32], bus_id_legacy[16];
    unsigned domain, bus, device, pci_device_id;
    unsigned long long memory_total, memory_used, memory_reserved; /* reserved: the driver's own */
    unsigned utilization, memory_utilization;
    unsigned temperature;
    unsigned power_mw, power_limit_mw;
    unsigned pcie_gen, pcie_width;
    int link_count;
    unsigned links[FAKE_MAX_LINKS]; /* 1: active */
    int process_count;
    fake_process processes[FAKE_MAX_PROCESSES];
    int errors[CALL_COUNT]; /* the nvmlReturn_t each call answers; 0 (success) unless injected */
} fake_device;

typedef struct {
    char driver_version[80];
    int init_error; /* what nvmlInit answers: 0, or an injected error */
    int count;
    fake_device devices[FAKE_MAX_DEVICES];
} fake_scenario;

/* Read and check the scenario file at `path` into `out`: 0, or -1 with one line in `error`. */
int scenario_load(const char *path, fake_scenario *out, char *error, int error_size);
/* NVML's code for an error's name without its prefix ("GPU_IS_LOST"), or -1. */
int fake_error_code(const char *name);
const char *fake_error_string(int code);

#endif
