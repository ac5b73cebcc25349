/* A scenario file, JSON, read whole and checked before anything uses it:
 *
 *   {"driver_version": "550.54.15", "init_error": null,
 *    "devices": [{"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-...", "pci_bus_id": "00000000:07:00.0",
 *                 "memory_total": 85899345920, "memory_used": 0, "memory_reserved": 0, "utilization": 0,
 *                 "memory_utilization": 0, "temperature": 31, "power_w": 62.5, "power_limit_w": 400,
 *                 "pcie_gen": 4, "pcie_width": 16, "nvlink": [1, 1, 0],
 *                 "processes": [{"pid": 1234, "used_memory": 1073741824, "sm_util": 50}],
 *                 "errors": {"temperature": "NOT_SUPPORTED", "all": "GPU_IS_LOST"}}]}
 *
 * A reading the scenario leaves out is one the card does not offer (NOT_SUPPORTED), as on real
 * cards that lack a sensor. Devices are enumerated in the file's order, whatever their bus ids.
 * Any mistake (bad JSON, an unknown key, a device named twice, a bad pid) rejects the whole file. */
#include "scenario.h"

#include <nvml.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

static const char *const CALL_NAMES[CALL_COUNT] = {
    "handle", "uuid", "name", "memory", "utilization", "temperature", "power", "power_limit",
    "processes", "pci", "nvlink", "pcie", "process_utilization"};

static const struct { int code; const char *name; const char *text; } ERRORS[] = {
    {NVML_SUCCESS, "SUCCESS", "Success"},
    {NVML_ERROR_UNINITIALIZED, "UNINITIALIZED", "Uninitialized"},
    {NVML_ERROR_INVALID_ARGUMENT, "INVALID_ARGUMENT", "Invalid Argument"},
    {NVML_ERROR_NOT_SUPPORTED, "NOT_SUPPORTED", "Not Supported"},
    {NVML_ERROR_NO_PERMISSION, "NO_PERMISSION", "Insufficient Permissions"},
    {NVML_ERROR_NOT_FOUND, "NOT_FOUND", "Not Found"},
    {NVML_ERROR_INSUFFICIENT_SIZE, "INSUFFICIENT_SIZE", "Insufficient Size"},
    {NVML_ERROR_DRIVER_NOT_LOADED, "DRIVER_NOT_LOADED", "Driver Not Loaded"},
    {NVML_ERROR_TIMEOUT, "TIMEOUT", "Timeout"},
    {NVML_ERROR_FUNCTION_NOT_FOUND, "FUNCTION_NOT_FOUND", "Function Not Found"},
    {NVML_ERROR_GPU_IS_LOST, "GPU_IS_LOST", "GPU is lost"},
    {NVML_ERROR_RESET_REQUIRED, "RESET_REQUIRED", "GPU requires restart"},
    {NVML_ERROR_LIB_RM_VERSION_MISMATCH, "LIB_RM_VERSION_MISMATCH", "RM has detected an NVML/RM version mismatch."},
    {NVML_ERROR_NO_DATA, "NO_DATA", "No data"},
    {NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "ARGUMENT_VERSION_MISMATCH", "Argument version mismatch"},
    {NVML_ERROR_UNKNOWN, "UNKNOWN", "Unknown Error"},
};

int fake_error_code(const char *name) {
    for (size_t i = 0; i < sizeof ERRORS / sizeof *ERRORS; i++)
        if (strcmp(ERRORS[i].name, name) == 0) return ERRORS[i].code;
    return -1;
}

const char *fake_error_string(int code) {
    for (size_t i = 0; i < sizeof ERRORS / sizeof *ERRORS; i++)
        if (ERRORS[i].code == code) return ERRORS[i].text;
    return "Unknown Error";
}

typedef struct {
    char *error;
    int size;
    const char *where; /* "device 3" or "the scenario" */
} check;

static int bad(check *c, const char *fmt, const char *what) {
    char message[200];
    snprintf(message, sizeof message, fmt, what);
    snprintf(c->error, c->size, "%s: %s", c->where, message);
    return -1;
}

static int only_keys(check *c, const json *object, const char *const *allowed) {
    for (int i = 0; i < object->count; i++) {
        int known = 0;
        for (const char *const *k = allowed; *k; k++) known |= strcmp(*k, object->keys[i]) == 0;
        if (!known) return bad(c, "unknown key \"%s\"", object->keys[i]);
    }
    return 0;
}

/* A whole number in [0, max] from `key` of `object`; 1 when read, 0 when absent, -1 when bad. */
static int number(check *c, const json *object, const char *key, double scale, double max,
                  unsigned long long *out) {
    const json *v = json_get(object, key);
    if (!v) return 0;
    if (v->type != JSON_NUMBER) return bad(c, "\"%s\" must be a number", key);
    double x = v->number * scale;
    if (!(x >= 0 && x <= max) || (scale == 1 && x != (double)(unsigned long long)x))
        return bad(c, "\"%s\" is out of range or not a whole number", key);
    *out = (unsigned long long)(x + 0.5);
    return 1;
}

static int text(check *c, const json *object, const char *key, char *out, size_t size) {
    const json *v = json_get(object, key);
    if (!v || v->type != JSON_STRING || v->string[0] == '\0') return bad(c, "\"%s\" must be a non-empty string", key);
    if (strlen(v->string) >= size) return bad(c, "\"%s\" is too long", key);
    strcpy(out, v->string);
    return 0;
}

static int read_processes(check *c, const json *list, fake_device *d) {
    static const char *const keys[] = {"pid", "used_memory", "sm_util", NULL};
    if (list->type != JSON_ARRAY) return bad(c, "\"%s\" must be a list", "processes");
    if (list->count > FAKE_MAX_PROCESSES) return bad(c, "%s", "more than 64 processes");
    for (int i = 0; i < list->count; i++) {
        const json *p = list->items[i];
        unsigned long long pid = 0, memory = 0, sm = 0;
        if (p->type != JSON_OBJECT) return bad(c, "a process must be an object with a \"%s\"", "pid");
        if (only_keys(c, p, keys) < 0) return -1;
        const json *pv = json_get(p, "pid");
        if (!pv || pv->type != JSON_NUMBER || number(c, p, "pid", 1, 4194304, &pid) != 1 || pid == 0)
            return bad(c, "a process's \"%s\" must be a whole number from 1 to 4194304 (a Linux pid)", "pid");
        const json *mv = json_get(p, "used_memory");
        if (mv && mv->type == JSON_NULL) memory = (unsigned long long)NVML_VALUE_NOT_AVAILABLE;
        else if (number(c, p, "used_memory", 1, 1e15, &memory) < 0) return -1;
        if (number(c, p, "sm_util", 1, 100, &sm) < 0) return -1;
        d->processes[i] = (fake_process){(unsigned)pid, memory, (unsigned)sm};
    }
    d->process_count = list->count;
    return 0;
}

static int read_errors(check *c, const json *errors, fake_device *d) {
    if (errors->type != JSON_OBJECT) return bad(c, "\"%s\" must be an object of call: error", "errors");
    for (int i = 0; i < errors->count; i++) {
        const json *v = errors->items[i];
        int code = v->type == JSON_STRING ? fake_error_code(v->string) : -1;
        if (code < 0) return bad(c, "the error for \"%s\" must be an NVML error name such as GPU_IS_LOST", errors->keys[i]);
        int all = strcmp(errors->keys[i], "all") == 0, found = all;
        for (int k = 0; k < CALL_COUNT; k++)
            if (all || strcmp(CALL_NAMES[k], errors->keys[i]) == 0) d->errors[k] = code, found = 1;
        if (!found) return bad(c, "\"%s\" is not a call errors can be injected into", errors->keys[i]);
    }
    return 0;
}

static int read_readings(check *c, const json *o, fake_device *d) {
    /* Each reading: its key, scale, maximum, where it goes (as a 64-bit or 32-bit field), its call. */
    unsigned long long v[10] = {0};
    static const struct { const char *key; double scale, max; int call; } R[] = {
        {"memory_total", 1, 1e15, CALL_MEMORY}, {"memory_used", 1, 1e15, CALL_MEMORY},
        {"utilization", 1, 100, CALL_UTILIZATION}, {"memory_utilization", 1, 100, CALL_UTILIZATION},
        {"temperature", 1, 200, CALL_TEMPERATURE}, {"power_w", 1000, 1e7, CALL_POWER},
        {"power_limit_w", 1000, 1e7, CALL_POWER_LIMIT}, {"pcie_gen", 1, 7, CALL_PCIE},
        {"pcie_width", 1, 32, CALL_PCIE}};
    for (size_t i = 0; i < sizeof R / sizeof *R; i++) {
        int got = number(c, o, R[i].key, R[i].scale, R[i].max, &v[i]);
        if (got < 0) return -1;
        if (got == 0) d->errors[R[i].call] = NVML_ERROR_NOT_SUPPORTED; /* the card lacks it */
    }
    /* What the driver sets aside for itself: optional (0), only the old memory call counts it as used. */
    unsigned long long reserved = 0;
    if (number(c, o, "memory_reserved", 1, 1e15, &reserved) < 0) return -1;
    if (v[1] + reserved > v[0]) return bad(c, "\"%s\" and memory_reserved are more than memory_total", "memory_used");
    d->memory_total = v[0], d->memory_used = v[1], d->memory_reserved = reserved;
    d->utilization = (unsigned)v[2], d->memory_utilization = (unsigned)v[3], d->temperature = (unsigned)v[4];
    d->power_mw = (unsigned)v[5], d->power_limit_mw = (unsigned)v[6];
    d->pcie_gen = (unsigned)v[7], d->pcie_width = (unsigned)v[8];
    return 0;
}

static int read_links(check *c, const json *links, fake_device *d) {
    if (!links) { d->errors[CALL_NVLINK] = NVML_ERROR_NOT_SUPPORTED; return 0; }
    if (links->type != JSON_ARRAY || links->count > FAKE_MAX_LINKS)
        return bad(c, "\"%s\" must be a list of at most 18 link states (1 active, 0 not)", "nvlink");
    for (int i = 0; i < links->count; i++) {
        if (links->items[i]->type != JSON_NUMBER && links->items[i]->type != JSON_BOOL)
            return bad(c, "\"%s\" must hold numbers or booleans", "nvlink");
        d->links[i] = links->items[i]->number != 0;
    }
    d->link_count = links->count;
    return 0;
}

static int read_device(check *c, const json *o, fake_device *d) {
    static const char *const keys[] = {
        "name", "uuid", "pci_bus_id", "pci_device_id", "memory_total", "memory_used", "memory_reserved", "utilization",
        "memory_utilization", "temperature", "power_w", "power_limit_w", "pcie_gen", "pcie_width", "nvlink",
        "processes", "errors", NULL};
    if (o->type != JSON_OBJECT) return bad(c, "%s", "a device must be an object");
    memset(d, 0, sizeof *d);
    if (only_keys(c, o, keys) < 0 || text(c, o, "name", d->name, sizeof d->name) < 0 ||
        text(c, o, "uuid", d->uuid, sizeof d->uuid) < 0 ||
        text(c, o, "pci_bus_id", d->bus_id, sizeof d->bus_id) < 0)
        return -1;
    char tail;
    unsigned function;
    if (sscanf(d->bus_id, "%x:%x:%x.%x%c", &d->domain, &d->bus, &d->device, &function, &tail) != 4 || d->bus > 0xff ||
        d->device > 31)
        return bad(c, "\"pci_bus_id\" %s is not domain:bus:device.function (00000000:07:00.0)", d->bus_id);
    snprintf(d->bus_id, sizeof d->bus_id, NVML_DEVICE_PCI_BUS_ID_FMT, d->domain, d->bus, d->device);
    snprintf(d->bus_id_legacy, sizeof d->bus_id_legacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT, d->domain, d->bus, d->device);
    unsigned long long pci_id = 0x20b510de; /* A100-SXM4-80GB */
    if (number(c, o, "pci_device_id", 1, 4294967295.0, &pci_id) < 0) return -1;
    d->pci_device_id = (unsigned)pci_id;
    if (read_readings(c, o, d) < 0 || read_links(c, json_get(o, "nvlink"), d) < 0) return -1;
    const json *procs = json_get(o, "processes"), *errors = json_get(o, "errors");
    if (procs && read_processes(c, procs, d) < 0) return -1;
    if (errors && read_errors(c, errors, d) < 0) return -1;
    return 0;
}

static int read_top(check *c, const json *doc, fake_scenario *out) {
    static const char *const keys[] = {"driver_version", "init_error", "devices", NULL};
    if (doc->type != JSON_OBJECT) return bad(c, "%s", "the document must be an object with \"devices\"");
    if (only_keys(c, doc, keys) < 0) return -1;
    strcpy(out->driver_version, "550.54.15");
    const json *version = json_get(doc, "driver_version"), *init = json_get(doc, "init_error");
    if (version && text(c, doc, "driver_version", out->driver_version, sizeof out->driver_version) < 0) return -1;
    if (init && init->type != JSON_NULL) {
        out->init_error = init->type == JSON_STRING ? fake_error_code(init->string) : -1;
        if (out->init_error < 0) return bad(c, "\"%s\" must be an NVML error name such as DRIVER_NOT_LOADED", "init_error");
    }
    const json *devices = json_get(doc, "devices");
    if (!devices || devices->type != JSON_ARRAY) return bad(c, "\"%s\" must be a list", "devices");
    if (devices->count > FAKE_MAX_DEVICES) return bad(c, "%s", "more than 64 devices");
    char where[40];
    for (int i = 0; i < devices->count; i++) {
        snprintf(where, sizeof where, "device %d", i);
        check dc = {c->error, c->size, where};
        if (read_device(&dc, devices->items[i], &out->devices[i]) < 0) return -1;
        for (int j = 0; j < i; j++) {
            if (strcmp(out->devices[j].uuid, out->devices[i].uuid) == 0)
                return bad(&dc, "uuid %s is another device's too (a device named twice)", out->devices[i].uuid);
            if (strcmp(out->devices[j].bus_id, out->devices[i].bus_id) == 0)
                return bad(&dc, "pci_bus_id %s is another device's too (a device named twice)", out->devices[i].bus_id);
        }
    }
    out->count = devices->count;
    return 0;
}

int scenario_load(const char *path, fake_scenario *out, char *error, int error_size) {
    FILE *f = fopen(path, "rb");
    if (!f) { snprintf(error, error_size, "cannot read the scenario file"); return -1; }
    size_t cap = 1 << 16, len = 0;
    char *body = malloc(cap);
    for (size_t got; body && (got = fread(body + len, 1, cap - len - 1, f)) > 0;) {
        len += got;
        if (len + 1 == cap) body = realloc(body, cap *= 2);
    }
    fclose(f);
    if (!body) { snprintf(error, error_size, "out of memory"); return -1; }
    body[len] = '\0';
    json *doc = json_parse(body, error, error_size);
    free(body);
    if (!doc) return -1;
    memset(out, 0, sizeof *out);
    check c = {error, error_size, "the scenario"};
    int result = read_top(&c, doc, out);
    json_free(doc);
    return result;
}
