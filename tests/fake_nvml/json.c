/* See json.h. Recursive descent over the text; every failure names the line it happened on. */
#include "json.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *at;
    const char *start;
    char *error;
    int error_size;
    int depth;
} reader;

static json *fail(reader *r, const char *what) {
    if (r->error[0] == '\0') {
        int line = 1;
        for (const char *p = r->start; p < r->at; p++) line += *p == '\n';
        snprintf(r->error, r->error_size, "not valid JSON at line %d: %s", line, what);
    }
    return NULL;
}

static void skip_space(reader *r) {
    while (*r->at == ' ' || *r->at == '\t' || *r->at == '\n' || *r->at == '\r') r->at++;
}

static json *node(enum json_type type) {
    json *v = calloc(1, sizeof *v);
    if (v) v->type = type;
    return v;
}

static char *read_string(reader *r) {
    /* r->at is on the opening quote. \uXXXX outside ASCII is kept as '?': names are ASCII. */
    size_t cap = 16, len = 0;
    char *out = malloc(cap);
    if (!out) return NULL;
    r->at++;
    while (*r->at != '"') {
        char c = *r->at;
        if (c == '\0' || c == '\n') { free(out); fail(r, "a string is not closed"); return NULL; }
        if (c == '\\') {
            r->at++;
            switch (*r->at) {
            case '"': c = '"'; break;
            case '\\': c = '\\'; break;
            case '/': c = '/'; break;
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                unsigned code = 0;
                if (sscanf(r->at + 1, "%4x", &code) != 1) { free(out); fail(r, "a bad \\u escape"); return NULL; }
                r->at += 4;
                c = code < 0x80 ? (char)code : '?';
                break;
            }
            default: free(out); fail(r, "an unknown escape in a string"); return NULL;
            }
        }
        if (len + 2 > cap) {
            char *bigger = realloc(out, cap *= 2);
            if (!bigger) { free(out); return NULL; }
            out = bigger;
        }
        out[len++] = c;
        r->at++;
    }
    r->at++;
    out[len] = '\0';
    return out;
}

static json *read_value(reader *r);

static int append(json *v, json *item, char *key) {
    json **items = realloc(v->items, (v->count + 1) * sizeof *items);
    if (!items) return 0;
    v->items = items;
    if (v->type == JSON_OBJECT) {
        char **keys = realloc(v->keys, (v->count + 1) * sizeof *keys);
        if (!keys) return 0;
        v->keys = keys;
        v->keys[v->count] = key;
    }
    v->items[v->count++] = item;
    return 1;
}

static json *read_container(reader *r, enum json_type type, char close) {
    json *v = node(type);
    if (!v) return fail(r, "out of memory");
    if (++r->depth > 64) { json_free(v); return fail(r, "nested too deeply"); }
    r->at++;
    skip_space(r);
    if (*r->at == close) { r->at++; r->depth--; return v; }
    for (;;) {
        char *key = NULL;
        skip_space(r);
        if (type == JSON_OBJECT) {
            if (*r->at != '"') { json_free(v); return fail(r, "expected a quoted key"); }
            if (!(key = read_string(r))) { json_free(v); return fail(r, "a bad key"); }
            skip_space(r);
            if (*r->at != ':') { free(key); json_free(v); return fail(r, "expected ':' after a key"); }
            r->at++;
        }
        json *item = read_value(r);
        if (!item || !append(v, item, key)) { free(key); json_free(item); json_free(v); return fail(r, "a bad value"); }
        skip_space(r);
        if (*r->at == ',') { r->at++; continue; }
        if (*r->at == close) { r->at++; r->depth--; return v; }
        json_free(v);
        return fail(r, type == JSON_OBJECT ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static json *read_value(reader *r) {
    skip_space(r);
    char c = *r->at;
    if (c == '{') return read_container(r, JSON_OBJECT, '}');
    if (c == '[') return read_container(r, JSON_ARRAY, ']');
    if (c == '"') {
        char *s = read_string(r);
        if (!s) return NULL;
        json *v = node(JSON_STRING);
        if (!v) { free(s); return fail(r, "out of memory"); }
        v->string = s;
        return v;
    }
    static const struct { const char *word; enum json_type type; double value; } words[] = {
        {"true", JSON_BOOL, 1}, {"false", JSON_BOOL, 0}, {"null", JSON_NULL, 0}};
    for (size_t i = 0; i < sizeof words / sizeof *words; i++) {
        size_t n = strlen(words[i].word);
        if (strncmp(r->at, words[i].word, n) == 0) {
            r->at += n;
            json *v = node(words[i].type);
            if (v) v->number = words[i].value;
            return v ? v : fail(r, "out of memory");
        }
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        char *end;
        double number = strtod(r->at, &end);
        if (end == r->at) return fail(r, "a bad number");
        r->at = end;
        json *v = node(JSON_NUMBER);
        if (v) v->number = number;
        return v ? v : fail(r, "out of memory");
    }
    return fail(r, c ? "unexpected character" : "the text ends early");
}

json *json_parse(const char *text, char *error, int error_size) {
    reader r = {text, text, error, error_size, 0};
    error[0] = '\0';
    json *v = read_value(&r);
    if (!v) return fail(&r, "a bad value");
    skip_space(&r);
    if (*r.at != '\0') { json_free(v); return fail(&r, "text after the document"); }
    return v;
}

void json_free(json *v) {
    if (!v) return;
    for (int i = 0; i < v->count; i++) {
        json_free(v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->string);
    free(v);
}

json *json_get(const json *object, const char *key) {
    if (!object || object->type != JSON_OBJECT) return NULL;
    for (int i = 0; i < object->count; i++)
        if (strcmp(object->keys[i], key) == 0) return object->items[i];
    return NULL;
}
