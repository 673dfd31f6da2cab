/* Prometheus text metrics and the worker-thread job runner. */
#include "daemon/daemon.h"
#include "daemon/netsvc.h"
#include "backend/child.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const double exec_bounds[WRD_EXEC_BUCKETS]
    = { 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60 };

void
wrd_metrics_exec (struct wrd *d, double seconds, bool ok)
{
  if (!ok)
    d->m.exec_failures++;
  size_t i = 0;
  while (i < WRD_EXEC_BUCKETS && seconds > exec_bounds[i])
    i++;
  d->m.exec_hist[i]++;
  d->m.exec_sum_s += seconds;
}

char *
wrd_metrics_text (struct wrd *d)
{
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream (&buf, &len);
  if (f == NULL)
    return strdup ("");
  unsigned by_state[SB_DESTROYING + 1] = { 0 };
  for (size_t i = 0; i < d->table_size; i++)
    for (struct sandbox *s = d->table[i]; s; s = s->hnext)
      by_state[s->state]++;
  fprintf (f, "# HELP warren_sandboxes Sandboxes on this node by state.\n"
              "# TYPE warren_sandboxes gauge\n");
  for (int s = 0; s <= SB_DESTROYING; s++)
    fprintf (f, "warren_sandboxes{state=\"%s\"} %u\n", sb_state_name ((enum sb_state)s),
             by_state[s]);
  fprintf (f,
           "# HELP warren_sandbox_creations_total Sandboxes handed out by create requests.\n"
           "# TYPE warren_sandbox_creations_total counter\n"
           "warren_sandbox_creations_total %llu\n"
           "# HELP warren_sandbox_creations_pooled_total Creates served from a warm pool.\n"
           "# TYPE warren_sandbox_creations_pooled_total counter\n"
           "warren_sandbox_creations_pooled_total %llu\n"
           "# TYPE warren_sandbox_create_failures_total counter\n"
           "warren_sandbox_create_failures_total %llu\n"
           "# TYPE warren_sandbox_destroys_total counter\n"
           "warren_sandbox_destroys_total %llu\n"
           "# TYPE warren_exec_total counter\n"
           "warren_exec_total %llu\n"
           "# TYPE warren_exec_failures_total counter\n"
           "warren_exec_failures_total %llu\n"
           "# TYPE warren_file_ops_total counter\n"
           "warren_file_ops_total %llu\n"
           "# TYPE warren_http_requests_total counter\n"
           "warren_http_requests_total %llu\n",
           (unsigned long long)d->m.creations, (unsigned long long)d->m.creations_pooled,
           (unsigned long long)d->m.create_failures, (unsigned long long)d->m.destroys,
           (unsigned long long)d->m.execs, (unsigned long long)d->m.exec_failures,
           (unsigned long long)d->m.files, (unsigned long long)d->m.http_requests);
  fprintf (f,
           "# HELP warren_http_connections Open TCP connections counted against the limit.\n"
           "# TYPE warren_http_connections gauge\n"
           "warren_http_connections %u\n"
           "# HELP warren_http_refused_total TCP connections closed before routing, by reason.\n"
           "# TYPE warren_http_refused_total counter\n"
           "warren_http_refused_total{reason=\"unauthorized\"} %llu\n"
           "warren_http_refused_total{reason=\"too_many_connections\"} %llu\n"
           "warren_http_refused_total{reason=\"timeout\"} %llu\n",
           d->n_tcp_conns, (unsigned long long)d->m.http_unauthorized,
           (unsigned long long)d->m.http_busy, (unsigned long long)d->m.http_timeouts);
  fprintf (f,
           "# HELP warren_vm_boot_timeouts_total VM guests that never started their agent.\n"
           "# TYPE warren_vm_boot_timeouts_total counter\n"
           "warren_vm_boot_timeouts_total %llu\n",
           (unsigned long long)d->m.vm_boot_timeouts);
  fprintf (f, "# HELP warren_exec_duration_seconds Exec round trip inside the daemon.\n"
              "# TYPE warren_exec_duration_seconds histogram\n");
  unsigned long long cum = 0;
  for (int i = 0; i < WRD_EXEC_BUCKETS; i++)
    {
      cum += d->m.exec_hist[i];
      fprintf (f, "warren_exec_duration_seconds_bucket{le=\"%g\"} %llu\n", exec_bounds[i], cum);
    }
  cum += d->m.exec_hist[WRD_EXEC_BUCKETS];
  fprintf (f,
           "warren_exec_duration_seconds_bucket{le=\"+Inf\"} %llu\n"
           "warren_exec_duration_seconds_sum %.6f\n"
           "warren_exec_duration_seconds_count %llu\n",
           cum, d->m.exec_sum_s, cum);
  fprintf (f, "# TYPE warren_pool_ready gauge\n");
  for (struct pool *p = d->pools; p; p = p->next)
    fprintf (f, "warren_pool_ready{image=\"%s\"} %u\nwarren_pool_target{image=\"%s\"} %u\n",
             p->image, p->ready, p->image, p->target);
  wrd_net_metrics (d, f);
  struct agent_conns_stats as;
  agent_conns_stats (&as);
  fprintf (f,
           "# HELP warren_agent_conns_open Agent connections open (docs/operations.md, Limits).\n"
           "# TYPE warren_agent_conns_open gauge\nwarren_agent_conns_open %zu\n"
           "# HELP warren_agent_conns_shed Idle agent connections closed, reopened on demand.\n"
           "# TYPE warren_agent_conns_shed gauge\nwarren_agent_conns_shed %zu\n"
           "# HELP warren_agent_conns_budget Agent connections kept open (--agent-conns).\n"
           "# TYPE warren_agent_conns_budget gauge\nwarren_agent_conns_budget %u\n"
           "# TYPE warren_agent_conn_sheds_total counter\nwarren_agent_conn_sheds_total %llu\n"
           "# TYPE warren_agent_conn_reconnects_total counter\n"
           "warren_agent_conn_reconnects_total %llu\n",
           as.open, as.shed, as.budget, (unsigned long long)as.sheds,
           (unsigned long long)as.reconnects);
  if (d->rt)
    {
      struct wr_zygote_stats zs;
      wr_zygote_stats (d->rt, &zs);
      fprintf (f,
               "# HELP warren_agent_zygote_forks_total Sandbox agents forked by the agent zygote.\n"
               "# TYPE warren_agent_zygote_forks_total counter\n"
               "warren_agent_zygote_forks_total %llu\n"
               "# HELP warren_agent_zygote_starts_total Agent zygotes started (restarts too).\n"
               "# TYPE warren_agent_zygote_starts_total counter\n"
               "warren_agent_zygote_starts_total %llu\n"
               "# HELP warren_agent_zygote_up Agent zygotes running (one per create slot in use).\n"
               "# TYPE warren_agent_zygote_up gauge\nwarren_agent_zygote_up %d\n",
               (unsigned long long)zs.forks, (unsigned long long)zs.starts, zs.running);
    }
  fclose (f);
  return buf;
}

/* ---- worker jobs: slow blocking work (imports) off the event loop ---- */

struct job
{
  struct wrd *d;
  wrd_job_fn fn, done;
  void *arg;
  struct event *ev;
};

/* jobs whose fn still runs, and jobs whose done is not yet delivered: the
 * daemon may not free what they use (the store, requests) before both are
 * 0 (wrd_jobs_drain) */
static pthread_mutex_t jobs_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t jobs_cond = PTHREAD_COND_INITIALIZER;
static unsigned jobs_running, jobs_undelivered;

static void
job_done_cb (evutil_socket_t fd, short what, void *arg)
{
  (void)fd;
  (void)what;
  struct job *j = arg;
  jobs_undelivered--;
  j->done (j->arg);
  event_free (j->ev);
  free (j);
}

static void *
job_thread (void *arg)
{
  struct job *j = arg;
  j->fn (j->arg);
  event_active (j->ev, EV_TIMEOUT, 0); /* thread-safe: evthread_use_pthreads() at startup */
  pthread_mutex_lock (&jobs_lock);
  jobs_running--;
  pthread_cond_broadcast (&jobs_cond);
  pthread_mutex_unlock (&jobs_lock);
  return NULL;
}

int
wrd_job_run (struct wrd *d, wrd_job_fn fn, wrd_job_fn done, void *arg)
{
  struct job *j = calloc (1, sizeof *j);
  if (j == NULL)
    return -ENOMEM;
  j->d = d;
  j->fn = fn;
  j->done = done;
  j->arg = arg;
  j->ev = event_new (d->base, -1, 0, job_done_cb, j);
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init (&attr);
  pthread_attr_setdetachstate (&attr, PTHREAD_CREATE_DETACHED);
  pthread_mutex_lock (&jobs_lock);
  jobs_running++;
  pthread_mutex_unlock (&jobs_lock);
  jobs_undelivered++;
  int r = pthread_create (&t, &attr, job_thread, j);
  pthread_attr_destroy (&attr);
  if (r != 0)
    {
      pthread_mutex_lock (&jobs_lock);
      jobs_running--;
      pthread_mutex_unlock (&jobs_lock);
      jobs_undelivered--;
      event_free (j->ev);
      free (j);
      return -r;
    }
  return 0;
}

void
wrd_jobs_drain (struct wrd *d)
{
  wr_registry_cancel_all (); /* a pull or push ends at once, with an error */
  pthread_mutex_lock (&jobs_lock);
  while (jobs_running > 0)
    pthread_cond_wait (&jobs_cond, &jobs_lock);
  pthread_mutex_unlock (&jobs_lock);
  /* their done events are active: run them while the requests still exist */
  while (jobs_undelivered > 0)
    event_base_loop (d->base, EVLOOP_NONBLOCK);
}
