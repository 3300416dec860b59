"""Plan a data-parallel run: step time, samples/s, statistical efficiency, goodput, time to a target and
the learning rate, for every number of ranks you might buy; and which to buy, and what limits it.

    python -m mpisgd.plan METRICS.jsonl --ranks 1,2,4,8 --link 10gbe
    python -m mpisgd.plan METRICS.jsonl --cluster cluster.toml --json plan.json --plot plan.png
    python -m mpisgd.plan --workload resnet50.toml --cluster dgx1.toml --ranks 8,16,32

The workload is one short mpisgd.train run's ``--metrics-file`` (its last run: the run record's buckets,
overlap, sharding and rate, an epoch's times and the noise scale), or a workload described by numbers
(``--workload FILE.toml``: a published setup, no run needed). The cluster is ``--cluster FILE.toml``
(ranks per node, the links within and between nodes, the library's algorithm, memory) or the flags;
links are presets (``--link``: published nccl-tests figures or measurements, each with its source), an
``allreduce_bw.py --json`` measurement, or alpha and beta. The model is mpisgd.app.planner.model's.

Pure computation: no MPI. Bad input is one line on stderr and exit 2. docs/plan.md says how to profile,
how to describe a workload and a cluster, how to read the table, and where the model stops holding.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mpisgd.app.options import add_version
from mpisgd.app.planner import model as planmodel
from mpisgd.app.planner import report
from mpisgd.app.planner import topology as topo
from mpisgd.app.planner.errors import PlanError, number
from mpisgd.app.planner.topology import ALGORITHMS, LIBRARIES, PRESETS, Cluster, Link, parse_link
from mpisgd.app.planner.workload import Rules, Workload, from_description, from_metrics, read_toml
from mpisgd.app.signals import EXIT_INTERRUPTED
from mpisgd.config import OPTIMIZERS
from mpisgd.errors import UsageError
from mpisgd.files import replaceable

MAX_RANKS = 1 << 20  # a plan beyond a million ranks is a typo
PATHS = ("metrics", "workload", "cluster", "link", "intra_link", "backend", "json", "plot")  # never "" for the default
OVERLAPS = ("auto", "ideal", "none")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors (an unknown option, a choice not offered) are one PlanError line, not usage + exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise PlanError(message)


def _int_list(text: str, what: str) -> list[int]:
    if not text.strip():  # an unset shell variable: never the default instead
        raise PlanError(f"{what} is empty: give comma-separated whole numbers (an unset shell variable?)")
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(f"{what} must be comma-separated whole numbers, got {text[:40]!r}") from None
    if not values or any(v < 1 for v in values):
        raise PlanError(f"{what} must be whole numbers >= 1, got {text[:40]!r}")
    if any(v > MAX_RANKS for v in values):
        raise PlanError(f"{what} must be at most {MAX_RANKS}, got {str(max(values))[:20]}...")
    return sorted(set(values))


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m mpisgd.plan", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("metrics", nargs="?", default=None,
                   help="the --metrics-file of a short mpisgd.train run (its last run; its last epoch is the profile)")
    p.add_argument("--workload", default=None, help="or a workload described by numbers (TOML; docs/plan.md)")
    g = p.add_argument_group("what to plan")
    g.add_argument("--ranks", default=None, help="ranks k to predict, comma-separated (default 1, 2, 4, ... up to "
                                                 "nodes x ranks per node, or 64)")
    g.add_argument("--accum-steps", default=None, help="micro-batches m per step, comma-separated (default: the "
                                                       "profile's); b stays the profile's")
    g.add_argument("--nodes", type=int, default=None, help="nodes available (caps k at nodes x ranks per node)")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node R: k <= R share one node (default: the cluster file's, else the profiled "
                        "run's)")
    g = p.add_argument_group("the cluster")
    g.add_argument("--cluster", default=None, help="a cluster description (TOML; docs/plan.md): ranks per node, links, "
                                                   "library, algorithm, memory; the flags below override it")
    g.add_argument("--link", default=None, help="the link between nodes: a preset (" + ", ".join(PRESETS) +
                                                ") or a benchmarks/allreduce_bw.py --json file")
    g.add_argument("--alpha-us", type=float, default=None, help="the link between nodes as alpha (us) ...")
    g.add_argument("--beta-gbit", type=float, default=None, help="... and beta (Gbit/s of bus bandwidth)")
    g.add_argument("--intra-link", default=None, help="the link within a node (preset or allreduce_bw JSON; "
                                                      "default shm on a CPU, the cluster file's otherwise)")
    g.add_argument("--backend", default=None, help="which backend's rows of an allreduce_bw JSON (default auto; "
                                                   "only with --link FILE or --intra-link FILE)")
    g.add_argument("--library", default=None, choices=LIBRARIES,
                   help="whose all-reduce: mpi (mpisgd on CPUs) or nccl (GPUs); default: the workload's device")
    g.add_argument("--algorithm", default=None, choices=ALGORITHMS,
                   help="auto: the library's choice (MPI: halving-doubling per level; NCCL: ring or tree, the "
                        "cheaper per bucket); or one forced")
    g.add_argument("--overlap", default=None, choices=OVERLAPS,
                   help="auto: the links' part runs behind backward, a CPU node's intra-node part is the cores' "
                        "work; ideal: both hidden where they can be; none: nothing hidden")
    g = p.add_argument_group("statistics and the rate (default: the run's own, from its run record or config)")
    g.add_argument("--noise-scale", type=float, default=None, help="B_noise in samples (default: the workload's)")
    g.add_argument("--epoch", type=int, default=None, help="profile this epoch's times (default: the last; a "
                                                         "metrics file only)")
    g.add_argument("--target-epochs", type=float, default=None,
                   help="the target: the loss B0 reaches after this many epochs (default: the profiled run's end)")
    g.add_argument("--lr", type=float, default=None, help="the run's --lr (eta0)")
    g.add_argument("--base-batch", type=int, default=None, help="the run's --base-batch (B0 of eta0)")
    g.add_argument("--lr-scaling", default=None, choices=("linear", "sqrt", "none"), help="the run's rule")
    g.add_argument("--optimizer", default=None, choices=OPTIMIZERS, help="the run's update rule (shown with the "
                                                                         "rate)")
    g.add_argument("--margin", type=float, default=0.10,
                   help="recommend the fewest ranks within this fraction of the most goodput")
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write the rows and the recommendation here")
    g.add_argument("--plot", default=None, help="write a plot of samples/s, goodput and efficiency against k "
                                                "(.png, .pdf, .svg)")
    add_version(p)
    return p


def _given_flags(args: argparse.Namespace) -> None:
    """Refuse a flag given empty (an unset shell variable) and one that would be ignored without a word."""
    for name in PATHS:
        value = getattr(args, name)
        if value is not None and not value.strip():
            what = "the metrics file" if name == "metrics" else f"--{name.replace('_', '-')}"
            raise PlanError(f"{what} is empty: give a {'name' if name == 'backend' else 'path'} "
                            "(an unset shell variable?)")
    if args.epoch is not None and args.workload is not None:
        raise PlanError(f"--epoch {args.epoch} applies to a metrics file (which epoch's times to profile); a "
                        "--workload gives its times itself: drop --epoch")
    if args.backend is not None and not any(spec is not None and spec not in PRESETS
                                            for spec in (args.link, args.intra_link)):
        raise PlanError(f"--backend {args.backend} picks the rows of a link measured by allreduce_bw.py (--link "
                        "FILE or --intra-link FILE); no link here is one (a preset has no backends): drop --backend")
    if args.target_epochs is not None and not args.target_epochs > 0:
        raise PlanError(f"--target-epochs must be > 0, got {args.target_epochs}")


def _finite_flags(args: argparse.Namespace) -> None:
    for name in ("alpha_us", "beta_gbit", "noise_scale", "target_epochs", "lr", "margin"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            raise PlanError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    for name in ("nodes", "ranks_per_node", "base_batch"):
        value = getattr(args, name)
        if value is not None and not 1 <= value <= MAX_RANKS * 1024:
            raise PlanError(f"--{name.replace('_', '-')} must be a whole number from 1 to {MAX_RANKS * 1024}, "
                            f"got {str(value)[:20]}")


def _rules(args: argparse.Namespace, rules: Rules) -> Rules:
    """The run's own rules, with the flags given over them (the source says which)."""
    given = {k: v for k, v in (("lr", args.lr), ("base_batch", args.base_batch), ("scaling", args.lr_scaling),
                                ("optimizer", args.optimizer)) if v is not None}
    if not given:
        return rules
    if "lr" in given and not given["lr"] > 0:
        raise PlanError(f"--lr must be > 0, got {args.lr}")
    flags = ", ".join(f"--{'lr-scaling' if k == 'scaling' else k.replace('_', '-')}" for k in given)
    return replace(rules, **given, source=f"{flags} over {rules.source}")


def _cluster(args: argparse.Namespace, w: Workload) -> Cluster:
    """The cluster file (if any) with the flags over it; the defaults follow the workload's device."""
    table: dict[str, Any] = {}
    source = "the command line"
    if args.cluster:
        table = read_toml(args.cluster, "a cluster description (docs/plan.md)")
        unknown = sorted(set(table) - {"name", "source", "ranks_per_node", "nodes", "intra", "inter", "library",
                                       "algorithm", "overlap", "node_memory_gib"})
        if unknown:
            raise PlanError(f"{args.cluster}: unknown key(s) {', '.join(unknown)}")
        source = f"{args.cluster}" + (f" ({table['name']})" if "name" in table else "")
    library = _pick(args.library, table, "library", "nccl" if w.device == "gpu" else "mpi")
    algorithm = _pick(args.algorithm, table, "algorithm", "auto")
    overlap = _pick(args.overlap, table, "overlap", "auto")
    if library not in LIBRARIES or algorithm not in ALGORITHMS or overlap not in OVERLAPS:
        raise PlanError(f"{source}: library {library!r}, algorithm {algorithm!r} or overlap {overlap!r} is unknown")
    per_node = _pick(args.ranks_per_node, table, "ranks_per_node", w.ranks_per_node)
    nodes = _pick(args.nodes, table, "nodes", None)
    from_file = args.ranks_per_node is None and "ranks_per_node" in table
    per_node = int(number(per_node, f"{source}: ranks_per_node" if from_file else "ranks per node", positive=True,
                          whole=True))
    if nodes is not None:
        nodes = int(number(nodes, "nodes", positive=True, whole=True))
    memory = table.get("node_memory_gib")
    if memory is not None:
        memory = number(memory, f"{source}: node_memory_gib", positive=True)
    if args.intra_link:
        intra = parse_link(args.intra_link, w.bucket_nbytes, args.backend, algorithm)
    elif "intra" in table:
        intra = topo.link_from_table(table["intra"], f"{source}: intra")
    else:
        intra = topo.preset("shm" if w.device == "cpu" else "pcie3")
    if (args.alpha_us is None) != (args.beta_gbit is None):
        raise PlanError("--alpha-us and --beta-gbit go together")
    if args.alpha_us is not None and args.link:
        raise PlanError("give the link between nodes once: --link, or --alpha-us and --beta-gbit")
    inter: Link | None = None
    if args.alpha_us is not None:
        if not (args.alpha_us >= 0 and args.beta_gbit > 0):
            raise PlanError("--alpha-us must be >= 0 and --beta-gbit > 0")
        inter = Link("given", args.alpha_us * 1e-6, args.beta_gbit * 1e9 / 8, "given on the command line")
    elif args.link:
        inter = parse_link(args.link, w.bucket_nbytes, args.backend, algorithm)
    elif "inter" in table:
        inter = topo.link_from_table(table["inter"], f"{source}: inter")
    return Cluster(intra, inter, per_node, library, algorithm, overlap, nodes, memory, source)


def _pick(flag: Any, table: dict[str, Any], key: str, default: Any) -> Any:
    """The flag where given, else the cluster file's value where it has the key (whatever it is: 0 and false
    are checked, not taken for "not given"), else the default."""
    if flag is not None:
        return flag
    return table[key] if key in table else default


def _workload(args: argparse.Namespace) -> tuple[Workload, Rules]:
    if (args.metrics is None) == (args.workload is None):
        raise PlanError("give one workload: a metrics file, or --workload FILE.toml")
    if args.workload:
        w, rules = from_description(args.workload)
        if args.noise_scale is not None:
            w = replace(w, noise_scale=args.noise_scale)
        return w, rules
    return from_metrics(args.metrics, args.epoch, args.noise_scale)


def _paths(args: argparse.Namespace) -> None:
    """Refuse an output that is an input (or the other output): --json METRICS would write over the profile."""
    inputs = [p for p in (args.metrics, args.metrics and f"{args.metrics}.config.toml", args.workload, args.cluster,
                          args.link, args.intra_link) if p and os.path.exists(p)]
    outputs = [(flag, p) for flag, p in (("--json", args.json), ("--plot", args.plot)) if p]
    for flag, out in outputs:
        for given in inputs:
            same = os.path.exists(out) and os.path.samefile(out, given) or \
                os.path.abspath(out) == os.path.abspath(given)
            if same:
                raise PlanError(f"{flag} {out} is an input of this plan ({given}): choose another path")
    if len(outputs) == 2 and os.path.abspath(outputs[0][1]) == os.path.abspath(outputs[1][1]):
        raise PlanError(f"--json and --plot are the same file ({args.json}): choose two")


def _replaceable_outputs(args: argparse.Namespace) -> None:
    """Refuse an output that holds a file of the user's: --json replaces only an empty file or an earlier plan,
    --plot only an empty file or a plot matplotlib made (mpisgd.files.replaceable)."""
    for flag, out, ours, what in (("--json", args.json, report.is_plan_json, "a plan this tool wrote"),
                                  ("--plot", args.plot, report.is_plot, "a plot (matplotlib's)")):
        if out and not replaceable(out, ours):
            raise PlanError(f"{flag} {out} exists and is not {what}: the plan would replace it; remove it or "
                            "choose another path")


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse, plan and print; returns what --json writes. Raises PlanError on bad input."""
    args = parser().parse_args(argv)
    _finite_flags(args)
    _given_flags(args)
    if args.noise_scale is not None and not args.noise_scale > 0:
        raise PlanError(f"--noise-scale must be > 0, got {args.noise_scale}")
    if not 0 <= args.margin < 1:
        raise PlanError(f"--margin must be in [0, 1), got {args.margin}")
    _paths(args)
    _replaceable_outputs(args)
    if args.plot:
        report.check_plot_path(args.plot)
    given_ranks = _int_list(args.ranks, "--ranks") if args.ranks is not None else None  # before the files
    accum = _int_list(args.accum_steps, "--accum-steps") if args.accum_steps is not None else None
    w, rules = _workload(args)
    rules = _rules(args, rules)
    net = _cluster(args, w)
    cap = net.nodes * net.per_node if net.nodes else None
    if given_ranks is not None:
        ranks = given_ranks
    else:
        top = cap or 64
        ranks = sorted({2**i for i in range(int(math.log2(top)) + 1)} | {top})
    if cap and max(ranks) > cap:
        raise PlanError(f"--ranks {max(ranks)} is more than {net.nodes} nodes x {net.per_node} ranks per node = {cap}")
    if net.inter is None and max(ranks) > net.per_node:
        raise PlanError(f"k={max(ranks)} spans nodes of {net.per_node} rank(s): give the link between them "
                        f"(--link {'|'.join(PRESETS)}|FILE, --alpha-us and --beta-gbit, or --cluster)")
    target = float(w.samples) if w.samples else None
    if args.target_epochs is not None:
        if not w.steps_per_epoch:
            raise PlanError("--target-epochs needs the epoch's size: a metrics file, or epoch_samples in the workload")
        target = args.target_epochs * w.steps_per_epoch * w.B
        if not target >= 1:
            raise PlanError(f"--target-epochs {args.target_epochs} is less than one sample of an epoch of "
                            f"{w.steps_per_epoch * w.B}: give a target of one step or more")
    rows = planmodel.plan(w, net, ranks, accum, rules, target)
    rec = planmodel.recommend(rows, args.margin)
    print(report.table(w, net, rows, rec, rules, target))
    result = report.result(w, net, rows, rec, rules, target, args.margin)
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(rows, rec, args.plot, f"{w.name}: B0={w.B}" + (
            f", B_noise={w.noise_scale:.0f}" if w.noise_scale else ""))
        print(f"wrote {args.plot}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    try:
        run(argv)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except UsageError as exc:
        print(f"mpisgd.plan: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, as the training CLI's
        print(f"mpisgd.plan: interrupted (SIGINT) (exit {EXIT_INTERRUPTED})", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return 0
