/* `warren bench`: JSON performance reports with the kernel floor and the
 * usual alternatives measured in the same run (docs/performance.md). */
#ifndef WR_CLI_BENCH_H
#define WR_CLI_BENCH_H

#include <warren/warren.h>

/* argv[0] is "bench" or the subcommand (floor | create | burst | exec | all).
 * Prints the report to stdout; returns the process exit status (0 ok,
 * 1 a measurement failed, 2 usage, 3 --check and a target was missed). */
int wr_cli_bench (warren_client_t *c, int argc, char **argv);
/* `warren bench cluster` (bench_cluster.c): starts its own etcd, simulated
 * nodes and gateways; argv[0] is "cluster". */
int wr_cli_bench_cluster (int argc, char **argv);
/* `warren bench pause` (bench_pause.c) and `warren bench qos` (bench_qos.c):
 * argv[0] is the subcommand. */
int wr_cli_bench_pause (warren_client_t *c, int argc, char **argv);
int wr_cli_bench_qos (warren_client_t *c, int argc, char **argv);

#endif
