/* A tiny JSON reader for scenario files: the whole document into a tree, or one error message
 * with its line. Enough for JSON written by people and by json.dump; no streaming, no output. */
#ifndef FAKE_NVML_JSON_H
#define FAKE_NVML_JSON_H

enum json_type { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT };

typedef struct json {
    enum json_type type;
    double number;          /* JSON_NUMBER, JSON_BOOL (0 or 1) */
    char *string;           /* JSON_STRING */
    int count;              /* JSON_ARRAY, JSON_OBJECT */
    struct json **items;
    char **keys;            /* JSON_OBJECT: keys[i] names items[i] */
} json;

/* The parsed document, or NULL with a message in `error` (at most `error_size` bytes). */
json *json_parse(const char *text, char *error, int error_size);
void json_free(json *value);
/* The member named `key` of an object, or NULL. */
json *json_get(const json *object, const char *key);

#endif
