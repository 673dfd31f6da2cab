#!/usr/bin/env python3
"""A GRPO-style rollout batch against a running warrend.

Each task is a tiny repository (shell scripts, so it runs on busybox) with a
failing test and a pool of candidate patches. For every task, G samples run in
parallel, each in its own sandbox composed of the base image plus that task's
workspace layer; the "agent" applies one candidate patch (sampled like a policy
would), runs the tests, and the verifier turns the exit status into a reward.
The batch prints per-task rewards, throughput and latency percentiles, and
removes every sandbox and image it made, also on Ctrl-C.

A sample the platform failed (warren.InfraError: agent or node lost, out of
capacity, daemon restarted mid-request; docs/errors.md) is masked, not scored:
it gets no reward and is left out of the means, so a platform hiccup never
teaches the policy that its answer was wrong. A task failure (tests fail,
non-zero exit, timeout, OOM) is a reward of 0 as usual. Sandboxes are created
with "deterministic" (fixed hostname, PYTHONHASHSEED, uptime from 0).

    python3 examples/rollout.py --short                 # quick start
    python3 examples/rollout.py --tasks 6 --samples 16  # a bigger batch
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import warren  # noqa: E402

# ---- the tasks: small repositories with a bug, a test, and candidate patches ----
# A patch is either a sed script applied to a file or a whole replacement file.
# "good" is the oracle label, used only to check the verifier afterwards.

TASKS: List[Dict] = [
    {
        "name": "calc",
        "files": {
            "lib.sh": "add() {\n  echo $(( $1 - $2 ))\n}\n",
            "test.sh": ". ./lib.sh\n[ \"$(add 2 3)\" = 5 ] || { echo 'add 2 3 != 5' >&2; exit 1; }\n"
                       "[ \"$(add -1 1)\" = 0 ] || exit 1\necho PASS\n",
        },
        "patches": [
            {"id": "plus", "good": True, "sed": ["lib.sh", "s/\\$1 - \\$2/$1 + $2/"]},
            {"id": "times", "good": False, "sed": ["lib.sh", "s/\\$1 - \\$2/$1 * $2/"]},
            {"id": "swap", "good": False, "sed": ["lib.sh", "s/\\$1 - \\$2/$2 - $1/"]},
            {"id": "noop", "good": False, "sed": ["lib.sh", "s/^add/add/"]},
        ],
    },
    {
        "name": "upper",
        "files": {
            "lib.sh": "to_upper() {\n  echo \"$1\" | tr 'A-Z' 'a-z'\n}\n",
            "test.sh": ". ./lib.sh\n[ \"$(to_upper abc)\" = ABC ] || exit 1\n"
                       "[ \"$(to_upper 'a b')\" = 'A B' ] || exit 1\necho PASS\n",
        },
        "patches": [
            {"id": "swap-tr", "good": True, "sed": ["lib.sh", "s/'A-Z' 'a-z'/'a-z' 'A-Z'/"]},
            {"id": "write", "good": True,
             "write": ["lib.sh", "to_upper() {\n  printf '%s\\n' \"$1\" | tr a-z A-Z\n}\n"]},
            {"id": "drop-quote", "good": False,
             "write": ["lib.sh", "to_upper() {\n  echo $1 | tr a-z A-Z | tr -d ' '\n}\n"]},
        ],
    },
    {
        "name": "countlines",
        "files": {
            "lib.sh": "count_lines() {\n  wc -w < \"$1\" | tr -d ' '\n}\n",
            "test.sh": ". ./lib.sh\nprintf 'a b\\nc d\\ne\\n' > /tmp/in.txt\n"
                       "[ \"$(count_lines /tmp/in.txt)\" = 3 ] || exit 1\necho PASS\n",
        },
        "patches": [
            {"id": "wc-l", "good": True, "sed": ["lib.sh", "s/wc -w/wc -l/"]},
            {"id": "wc-c", "good": False, "sed": ["lib.sh", "s/wc -w/wc -c/"]},
            {"id": "syntax", "good": False, "write": ["lib.sh", "count_lines() {\n  wc -l <\n"]},
        ],
    },
    {
        "name": "fizz",
        "files": {
            "lib.sh": "fizz() {\n  if [ $(( $1 % 3 )) -eq 0 ]; then echo Fizz\n"
                      "  elif [ $(( $1 % 5 )) -eq 0 ]; then echo Buzz\n  else echo $1; fi\n}\n",
            "test.sh": ". ./lib.sh\n[ \"$(fizz 3)\" = Fizz ] && [ \"$(fizz 5)\" = Buzz ] && "
                       "[ \"$(fizz 15)\" = FizzBuzz ] && [ \"$(fizz 7)\" = 7 ] || exit 1\necho PASS\n",
        },
        "patches": [
            {"id": "add-15", "good": True,
             "sed": ["lib.sh", "s/  if \\[ \\$(( \\$1 % 3 )) -eq 0 \\]; then echo Fizz/"
                               "  if [ $(( $1 % 15 )) -eq 0 ]; then echo FizzBuzz\\n"
                               "  elif [ $(( $1 % 3 )) -eq 0 ]; then echo Fizz/"]},
            {"id": "add-15-late", "good": False,
             "sed": ["lib.sh", "s/  else echo \\$1; fi/  elif [ $(( $1 % 15 )) -eq 0 ]; then "
                               "echo FizzBuzz\\n  else echo $1; fi/"]},
            {"id": "noop", "good": False, "sed": ["lib.sh", "s/Fizz/Fizz/"]},
        ],
    },
    {
        "name": "maxof",
        "files": {
            "lib.sh": "max_of() {\n  m=$1\n  for x; do [ \"$x\" -lt \"$m\" ] && m=$x; done\n  echo $m\n}\n",
            "test.sh": ". ./lib.sh\n[ \"$(max_of 3 9 2)\" = 9 ] && [ \"$(max_of -5 -2)\" = -2 ] || exit 1\n"
                       "echo PASS\n",
        },
        "patches": [
            {"id": "gt", "good": True, "sed": ["lib.sh", "s/-lt/-gt/"]},
            {"id": "ge", "good": True, "sed": ["lib.sh", "s/-lt/-ge/"]},
            {"id": "le", "good": False, "sed": ["lib.sh", "s/-lt/-le/"]},
        ],
    },
    {
        "name": "slug",
        "files": {
            "lib.sh": "slug() {\n  echo \"$1\" | tr 'A-Z' 'a-z' | tr ' ' '_'\n}\n",
            "test.sh": ". ./lib.sh\n[ \"$(slug 'Hello World')\" = hello-world ] || exit 1\necho PASS\n",
        },
        "patches": [
            {"id": "dash", "good": True, "sed": ["lib.sh", "s/tr ' ' '_'/tr ' ' '-'/"]},
            {"id": "sed-dash", "good": True, "sed": ["lib.sh", "s/tr ' ' '_'/sed 's, ,-,g'/"]},
            {"id": "delete", "good": False, "sed": ["lib.sh", "s/tr ' ' '_'/tr -d ' '/"]},
        ],
    },
]


@dataclass
class Sample:
    task: str
    index: int
    patch: str
    good: bool
    reward: float = 0.0
    create_ms: float = 0.0
    exec_ms: List[float] = field(default_factory=list)
    total_ms: float = 0.0
    steps: int = 0
    error: Optional[str] = None
    masked: bool = False  # the platform failed: no reward, not scored


def pct(xs: List[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def write_task_tree(root: str, task: Dict) -> None:
    d = os.path.join(root, "work", task["name"])
    os.makedirs(d, mode=0o755)
    for name, text in task["files"].items():
        with open(os.path.join(d, name), "w") as f:
            f.write(text)


async def rollout(client: warren.AsyncClient, base: str, layer: str, task: Dict, index: int,
                  patch: Dict, labels: Dict[str, str], memory_mb: int) -> Sample:
    """One trajectory: sandbox from base + task layer, apply a patch, verify."""
    s = Sample(task["name"], index, patch["id"], patch["good"])
    t0 = time.perf_counter()
    try:
        await trajectory(client, base, layer, task, index, patch, labels, memory_mb, s, t0)
    except warren.InfraError as e:
        # whose failure: the platform's, so this sample says nothing about
        # the policy; a TaskError (a bad request) still propagates
        s.masked, s.reward, s.error = True, 0.0, f"infra failure (masked): {e}"
    s.total_ms = (time.perf_counter() - t0) * 1e3
    return s


async def trajectory(client: warren.AsyncClient, base: str, layer: str, task: Dict, index: int,
                     patch: Dict, labels: Dict[str, str], memory_mb: int, s: Sample,
                     t0: float) -> None:
    work = f"/work/{task['name']}"
    async with client.create(image=base, layers=[layer], memory_mb=memory_mb, ttl_s=900,
                             labels=labels, deterministic={"seed": index}) as sb:
        s.create_ms = (time.perf_counter() - t0) * 1e3
        # Agent step 1: look at the repository (what an LLM would do first).
        t = time.perf_counter()
        await sb.list_dir(work)
        s.exec_ms.append((time.perf_counter() - t) * 1e3)
        # Agent step 2: apply the candidate patch.
        t = time.perf_counter()
        if "sed" in patch:
            fname, script = patch["sed"]
            r = await sb.exec(["sed", "-i", "-e", script, fname], cwd=work, timeout=10,
                              step=f"{s.task}-{index}-patch")
            if r.exit_code != 0:
                s.error = f"patch failed: {r.stderr.strip()}"
        else:
            fname, content = patch["write"]
            await sb.write_file(f"{work}/{fname}", content)
        s.exec_ms.append((time.perf_counter() - t) * 1e3)
        # Verifier: run the tests; reward = 1 when they pass.
        t = time.perf_counter()
        r = await sb.exec(["sh", "test.sh"], cwd=work, timeout=30, step=f"{s.task}-{index}-test")
        s.exec_ms.append((time.perf_counter() - t) * 1e3)
        s.steps = 3
        s.reward = 1.0 if r.ok and "PASS" in r.stdout else 0.0


async def run(args: argparse.Namespace) -> Dict:
    run_id = uuid.uuid4().hex[:8]
    labels = {"rollout": run_id}
    rng = random.Random(args.seed)
    tasks = TASKS[: args.tasks]
    tmp = tempfile.mkdtemp(prefix="warren-rollout-")
    images: List[str] = []
    samples: List[Sample] = []
    async with warren.AsyncClient(args.host, max_connections=args.connections) as client:
        try:
            base = args.base
            if base is None:
                base = "base:bookworm" if await client.images.exists("base:bookworm") else "busybox:latest"
            # One workspace layer per task, imported from a temp tree /work/<task>.
            layer_of = {}
            for task in tasks:
                root = os.path.join(tmp, task["name"])
                write_task_tree(root, task)
                os.chmod(root, 0o755)
                name = f"rollout-{task['name']}:{run_id}"
                await client.images.import_(name, root)
                images.append(name)
                layer_of[task["name"]] = name
            t0 = time.perf_counter()
            jobs = []
            for task in tasks:
                for i in range(args.samples):
                    patch = rng.choice(task["patches"])
                    jobs.append(rollout(client, base, layer_of[task["name"]], task, i, patch,
                                        labels, args.memory_mb))
            results = await asyncio.gather(*jobs, return_exceptions=True)
            wall = time.perf_counter() - t0
            for r in results:
                if isinstance(r, BaseException):
                    if isinstance(r, asyncio.CancelledError):
                        raise r
                    samples.append(Sample("?", -1, "?", False, error=f"{type(r).__name__}: {r}",
                                          masked=isinstance(r, warren.InfraError)))
                else:
                    samples.append(r)
        finally:
            # Shielded deletes already ran in each sandbox's `async with`; sweep
            # by label anyway (covers a create whose answer was lost), then drop
            # the task images.
            async def sweep() -> None:
                await client.drain()
                for s in await client.list(labels=labels):
                    await client.delete(s.id, missing_ok=True)
                for name in images:
                    try:
                        await client.images.delete(name)
                    except warren.WarrenError:
                        pass
            try:
                await asyncio.shield(sweep())
            except warren.WarrenError as e:
                print(f"rollout: cleanup incomplete: {e}", file=sys.stderr)
            shutil.rmtree(tmp, ignore_errors=True)
    creates = [s.create_ms for s in samples if s.error is None or s.create_ms]
    execs = [x for s in samples for x in s.exec_ms]
    per_task = {}
    for task in tasks:
        rs = [s.reward for s in samples if s.task == task["name"] and not s.masked]
        masked = sum(1 for s in samples if s.task == task["name"] and s.masked)
        per_task[task["name"]] = {"samples": len(rs), "masked": masked,
                                  "mean": sum(rs) / len(rs) if rs else 0.0,
                                  "max": max(rs) if rs else 0.0}
    return {
        "run_id": run_id, "base": base, "tasks": len(tasks), "samples_per_task": args.samples,
        "sandboxes": len(samples), "wall_s": wall,
        "sandboxes_per_s": len(samples) / wall if wall else 0.0,
        "steps_per_s": sum(s.steps for s in samples) / wall if wall else 0.0,
        "create_ms": {"p50": pct(creates, 50), "p90": pct(creates, 90), "p99": pct(creates, 99)},
        "step_ms": {"p50": pct(execs, 50), "p90": pct(execs, 90), "p99": pct(execs, 99)},
        "per_task": per_task,
        "verifier_agrees": sum(1 for s in samples if not s.masked and (s.reward == 1.0) == s.good),
        "scored": sum(1 for s in samples if not s.masked),
        "masked": sum(1 for s in samples if s.masked),
        "errors": [s.error for s in samples if s.error and not s.masked],
        "infra_failures": [s.error for s in samples if s.masked],
        # a masked sample has no reward (None), never 0
        "samples": [{"task": s.task, "index": s.index, "patch": s.patch, "good": s.good,
                     "reward": None if s.masked else s.reward, "masked": s.masked}
                    for s in samples],
    }


def report(r: Dict) -> None:
    print(f"rollout {r['run_id']}: {r['tasks']} tasks x {r['samples_per_task']} samples "
          f"on {r['base']} + task layer")
    print(f"{'task':<12} {'mean reward':>11} {'max':>5} {'masked':>6}")
    for name, t in r["per_task"].items():
        print(f"{name:<12} {t['mean']:>11.3f} {t['max']:>5.1f} {t['masked']:>6}")
    print(f"throughput: {r['sandboxes_per_s']:.1f} sandboxes/s, {r['steps_per_s']:.1f} steps/s "
          f"({r['sandboxes']} sandboxes in {r['wall_s']:.2f} s)")
    c, e = r["create_ms"], r["step_ms"]
    print(f"latency ms: create p50 {c['p50']:.1f} p90 {c['p90']:.1f} p99 {c['p99']:.1f}; "
          f"step p50 {e['p50']:.1f} p90 {e['p90']:.1f} p99 {e['p99']:.1f}")
    print(f"verifier agrees with the oracle on {r['verifier_agrees']}/{r['scored']} scored samples"
          f" ({r['masked']} masked as infra failures)")
    for err in r["errors"]:
        print(f"error: {err}")
    for err in r["infra_failures"]:
        print(f"masked: {err}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default=None, help="unix:/path/sock or http://host:port "
                   "(default $WARREN_HOST or the default socket)")
    p.add_argument("--tasks", type=int, default=len(TASKS), help="number of tasks (max %d)" % len(TASKS))
    p.add_argument("--samples", "-G", type=int, default=16, help="samples per task")
    p.add_argument("--base", default=None, help="base image (default base:bookworm if present, "
                   "else busybox:latest)")
    p.add_argument("--memory-mb", type=int, default=64)
    p.add_argument("--connections", type=int, default=128, help="max HTTP connections")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--short", action="store_true", help="3 tasks x 4 samples (quick start)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args()
    if args.short:
        args.tasks, args.samples = 3, 4
    args.tasks = max(1, min(args.tasks, len(TASKS)))
    try:
        r = asyncio.run(run(args))
    except KeyboardInterrupt:
        print("rollout: interrupted; sandboxes and images removed", file=sys.stderr)
        return 130
    except warren.WarrenError as e:
        print(f"rollout: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(r))
    else:
        report(r)
    return 0 if not r["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
