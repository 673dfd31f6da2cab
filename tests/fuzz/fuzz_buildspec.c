/* The image build spec (src/daemon/build.c): instruction lines with "\"
 * continuations (parse_spec), ENV/LABEL key-value lists (parse_kv) and COPY
 * word splitting; then the cache key of every step. */
#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Weverything"
#include "daemon/build.c"
#pragma clang diagnostic pop

#include <stdlib.h>

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  static struct build b;
  memset (&b, 0, sizeof b);
  b.spec = strndup ((const char *)data, size);
  if (b.spec == NULL)
    return 0;
  wr_err_t err;
  if (parse_spec (&b, &err) == 0)
    {
      char cur[72] = "sha256:0";
      for (size_t i = 0; i < b.n_steps; i++)
        {
          const struct step *s = &b.steps[i];
          if (s->op == OP_ENV || s->op == OP_LABEL)
            {
              json_t *kv = json_object ();
              (void)parse_kv (s->arg, s->op == OP_ENV, kv, s->line, &err);
              json_decref (kv);
            }
          else if (s->op == OP_COPY)
            {
              char args[4096];
              snprintf (args, sizeof args, "%s", s->arg);
              char *w[64];
              (void)split_words (args, w, 64);
            }
          char hex[65];
          key_of (cur, s, NULL, hex);
          snprintf (cur, sizeof cur, "sha256:%s", hex);
        }
    }
  free (b.spec);
  return 0;
}
