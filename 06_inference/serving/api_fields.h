// api_fields.h: the fields a request may carry, each honoured or refused (api_fields.c)
#ifndef API_FIELDS_H
#define API_FIELDS_H

#include <cjson/cJSON.h>
#include <stdbool.h>

enum { API_COMPLETIONS = 1, API_CHAT = 2 };

// The first field of the request object req (to endpoint API_COMPLETIONS or API_CHAT) that this
// server refuses: one it does not know, or one that asks for what it does not do; *why says
// which. NULL when it honours every field.
const char *api_refused_field(const cJSON *req, unsigned endpoint, const char **why);

#endif
