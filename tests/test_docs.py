"""The docs say what runs: every `python <script>.py ...` command in README.md, docs/*.md and docs/evidence/*.md
(code blocks and inline code) is accepted by that script's own parser, called in-process without running anything;
every `bash X.sh` / `pip install -r X` names an existing file; every relative link, reference link and image
resolves (with its #anchor, for markdown targets); every table row has its header's number of cells; each method
page has the fixed sections in order, its bottom line, `--help` and a one-minute run on the first screen, and a
Results that opens with a summary table and a figure; every code pointer `<script>.py: <name>` names a definition
of that script, and each bullet of a method page's "Implementation details and deviations" holds one; the README
reads at a glance (1,500 words, 120 characters a line, one Results row per claim, cells of 100 characters) and no
page exceeds 3,000 words; every number of the README's Results, of each page's summary table and of the moved
figures in the pages' text agrees with its source (the runs in benchmarks/results as collect.py reads them, the
paper's numbers as collect.py tables them), the mutation counts with tests/README.md, the overhead bound and the
speed figures with docs/speed.md. Parsers only: about a second."""

import argparse
import functools
import glob
import importlib
import itertools
import json
import os
import re
import shlex
import statistics
import sys

import pytest

from helpers import stand_in_folder, stand_in_groups, stand_in_tinyimagenet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)
DOCS = ["README.md"] + sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "docs", "*.md")) + glob.glob(os.path.join(ROOT, "docs", "evidence", "*.md"))
)
METHODS = ["fedavg", "fedbabu", "fedfn", "fedln", "fednnnn", "anfr"]
SECTIONS = [  # run command, flags and verdict first: the page's bottom line stands above "Paper and idea"
    "Paper and idea",
    "Usage",
    "Results",
    "Flags beyond fedavg.py's",
    "What is logged",
    "Implementation details and deviations",
]
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
SEPARATORS = {"&&", "||", ";", "|", "&"}


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


# ---------------------------------------------------------------------------------------------
# Commands: code blocks (with continuation lines, VAR=... assignments and for loops) and inline code
# ---------------------------------------------------------------------------------------------
def tokens(text):
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def segments(words):
    """Split a token list at ; && || | & into simple commands."""
    out, cur = [], []
    for w in words:
        if w in SEPARATORS:
            out.append(cur)
            cur = []
        else:
            cur.append(w)
    return [s for s in out + [cur] if s]


def expand(line, env):
    """Every expansion of $VAR / ${VAR} by env (a list of values per name: one for assignments, several
    for loop variables); unknown variables ($DATA_DIR) are left as they are."""
    names = [n for n in env if re.search(r"\$(\{%s\}|%s\b)" % (n, n), line)]
    for values in itertools.product(*(env[n] for n in names)):
        text = line
        for n, v in zip(names, values):
            text = re.sub(r"\$(\{%s\}|%s\b)" % (n, n), lambda _: v, text)
        yield text


def block_commands(code):
    """Simple commands (token lists) of a shell code block."""
    env, out = {}, []
    for line in re.sub(r"\\\n", " ", code).splitlines():
        for seg in segments(tokens(line)):  # register loop variables and assignments first
            while seg and seg[0] in ("do", "then", "else"):
                seg = seg[1:]
            if not seg:
                continue
            if seg[0] == "for" and len(seg) > 3 and seg[2] == "in":
                env[seg[1]] = seg[3:]
            elif len(seg) == 1 and re.fullmatch(r"\w+=.*", seg[0]):
                name, value = seg[0].split("=", 1)
                env[name] = [value]
        for text in expand(line, env):
            for seg in segments(tokens(text)):
                while seg and seg[0] in ("do", "then", "else"):
                    seg = seg[1:]
                while seg and re.fullmatch(r"\w+=.*", seg[0]):  # VAR=value command
                    seg = seg[1:]
                if seg and seg[0] not in ("for", "done", "fi"):
                    out.append(seg)
    return out


def documented_commands():
    """(where, argv) for every python/bash/pip command in the docs."""
    found = []
    for doc in DOCS:
        text = read(doc)
        for m in FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            body = m.group(0).split("\n", 1)[1].rsplit("```", 1)[0]
            found += [(f"{doc}:{line}", argv) for argv in block_commands(body)]
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for m in re.finditer(r"`([^`]+)`", prose):
            if m.group(1).startswith(("python ", "torchrun ")) and ".py" in m.group(1):
                line = prose[: m.start()].count("\n") + 1
                found.append((f"{doc}:{line} (inline)", tokens(m.group(1).replace("\n", " "))))

    def real(argv):
        return argv[0] in ("bash", "pip", "torchrun") or (
            argv[0] in ("python", "python3")
            and len(argv) > 1
            and (argv[1] == "-m" or re.fullmatch(r"[\w./-]+\.py", argv[1]))
        )

    return [(where, argv) for where, argv in found if real(argv)]  # not `python <script>.py ...`


COMMANDS = documented_commands()


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Stand-ins for placeholders: an image folder with train/ and test/ class folders, a file, a run
    folder to --resume per script (config.json from that script's own defaults, an empty checkpoint)."""
    root = tmp_path_factory.mktemp("docs")
    folder = stand_in_folder(root / "cifar10")
    init = root / "init.pt"
    init.write_bytes(b"")
    groups, tiny = stand_in_groups(root / "pacs"), stand_in_tinyimagenet(root / "tiny-imagenet-200")
    return {"data_dir": str(folder), "groups": groups, "tinyimagenet": tiny, "file": str(init), "root": root}


def resume_folder(module, name, places, monkeypatch):
    run = places["root"] / f"resume-{name}"
    if not run.exists():
        run.mkdir()
        monkeypatch.setattr(sys, "argv", [f"{name}.py", "--dataset", "synthetic", "--device", "cpu"])
        args = module.parse_args()
        (run / "config.json").write_text(
            json.dumps({k: v for k, v in vars(args).items() if k not in ("resume", "stop_after")})
        )
        (run / "checkpoint.pt").write_bytes(b"")
    return str(run)


def fill_placeholders(args, module, name, places, monkeypatch):
    """--data-dir DIR / $DATA_DIR / ~/cifar10 -> the stand-in folder (in groups with --natural or
    --clients-per-domain; Tiny-ImageNet's layout with --dataset tinyimagenet); --init-from -> a file; --resume
    -> a run folder (also fn_growth.py's --run); --device cuda -> cpu (this machine may have no GPU)."""
    args = list(args)
    kind = "groups" if {"--natural", "--clients-per-domain"} & set(args) else "data_dir"
    kind = "tinyimagenet" if "tinyimagenet" in args else kind
    for i, a in enumerate(args[:-1]):
        if a == "--data-dir":
            args[i + 1] = places[kind]
        elif a == "--init-from":
            args[i + 1] = places["file"]
        elif a == "--resume":
            args[i + 1] = resume_folder(module, name, places, monkeypatch)
        elif a == "--run" and name == "fn_growth":  # a fedfn.py run folder
            args[i + 1] = resume_folder(importlib.import_module("fedfn"), "fedfn", places, monkeypatch)
        elif a == "--device" and args[i + 1].startswith("cuda"):
            args[i + 1] = "cpu"
    return args


def option_strings(parser):
    """Every option string of a parser and of its subcommands' parsers."""
    out = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= option_strings(sub)
    return out


def parse(script, args, places, monkeypatch):
    """Run the script's own argument parsing on args (raises SystemExit like argparse), then check that
    every --flag is written out in full (argparse would also accept an abbreviation)."""
    name = os.path.splitext(os.path.basename(script))[0]
    module = importlib.import_module(name)
    args = fill_placeholders(args, module, name, places, monkeypatch)
    parsers, real_parse = [], argparse.ArgumentParser.parse_args

    def spy(self, *a, **k):
        parsers.append(self)
        return real_parse(self, *a, **k)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", spy)
    parsed = None
    if name == "plot":
        module.parse(args)
    elif name == "collect":  # no parse function: main() without reading any run folder
        monkeypatch.setattr(module, "gather", lambda root: {})
        module.main(args)
    else:
        monkeypatch.setattr(sys, "argv", [script, *args])
        parsed = module.parse_args()
    known = option_strings(parsers[-1])
    for a in args:
        # After "--": another program's flags (profile_round.py passes them to fedavg.py).
        if a == "--":
            break
        if a.startswith("--"):
            assert a.split("=")[0] in known, f"{a.split('=')[0]} is not a flag of {script} (abbreviated or unknown)"
    return parsed


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_is_accepted(where, argv, places, monkeypatch, capsys):
    if argv[0] == "bash":
        assert os.path.isfile(os.path.join(ROOT, argv[1])), f"{where}: no {argv[1]}"
        return
    if argv[0] == "pip":
        if "-r" in argv:
            assert os.path.isfile(os.path.join(ROOT, argv[argv.index("-r") + 1])), f"{where}: {' '.join(argv)}"
        return
    if argv[0] == "torchrun":  # torchrun's own flags by its parser, then the script's by the script's
        from torch.distributed.run import get_args_parser

        try:
            launch = get_args_parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{where}: torchrun rejects `{shlex.join(argv)}`: {capsys.readouterr().err.strip()}")
        argv = ["python", launch.training_script, *launch.training_script_args]
    if argv[1] == "-m":
        return  # python -m pytest ...
    script = argv[1]
    assert os.path.isfile(os.path.join(ROOT, script)), f"{where}: no script {script}"
    monkeypatch.chdir(ROOT)
    try:
        parse(script, argv[2:], places, monkeypatch)
    except SystemExit as e:
        if e.code not in (0, None):  # --help exits 0
            pytest.fail(f"{where}: `{shlex.join(argv)}` rejected (exit {e.code}): {capsys.readouterr().err.strip()}")


def test_the_commands_are_found():
    """The extraction itself: loops, assignments, continuation lines and inline commands all count."""
    scripts = {argv[1] for _, argv in COMMANDS if argv[0] == "python"}
    assert {f"{m}.py" for m in METHODS} <= scripts
    assert {"benchmarks/plot.py", "benchmarks/collect.py"} <= scripts
    assert any("--ft-epochs" in argv and "--client-test" in argv for _, argv in COMMANDS)  # a continued line
    anfr_loop = [
        argv for _, argv in COMMANDS if argv[:2] == ["python", "anfr.py"] and "--agg" in argv and "--out" in argv
    ]
    assert {(a[a.index("--arch") + 1], a[a.index("--agg") + 1]) for a in anfr_loop} >= {
        ("bn", "fedavg"),
        ("anfr", "fedadam"),
    }
    assert any(
        argv[:2] == ["python", "fedfn.py"] and "--shards" in argv and w.endswith("(inline)") for w, argv in COMMANDS
    )
    code = 'D="--dataset folder --data-dir ~/x"  # note\nfor a in 1 2; do\n  python s.py $D --a $a \\\n  --b; done\n'
    assert block_commands(code) == [
        ["python", "s.py", "--dataset", "folder", "--data-dir", "~/x", "--a", n, "--b"] for n in "12"
    ]


def test_a_bad_flag_is_caught(places, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        parse("fedfn.py", ["--dataset", "folder", "--data-dir", "DIR", "--shardz", "2"], places, monkeypatch)
    assert e.value.code == 2
    with pytest.raises(SystemExit):  # the scripts refuse an abbreviation (--shard for --shards) themselves
        parse("fedfn.py", ["--dataset", "folder", "--data-dir", "DIR", "--shard", "2"], places, monkeypatch)
    with pytest.raises(SystemExit):  # placeholders are filled in, real checks still apply
        parse(
            "fedfn.py",
            ["--dataset", "folder", "--data-dir", "DIR", "--shards", "2", "--alpha", "0.1"],
            places,
            monkeypatch,
        )
    parse("benchmarks/plot.py", ["partition", "RUN", "--split", "test"], places, monkeypatch)
    with pytest.raises(AssertionError, match="not a flag"):
        parse("benchmarks/plot.py", ["runs", "a", "--mean"], places, monkeypatch)


# ---------------------------------------------------------------------------------------------
# Dataset commands: each with its paper's model and optimizer (docs/datasets.md, "One command per dataset")
# ---------------------------------------------------------------------------------------------
FEDBABU_EMNIST = {"model": "convnet3", "lr": 0.1, "momentum": 0.9, "batch_size": 50, "frac": 0.1, "local_epochs": 10,
                  "lr_decay_at": [0.5, 0.75], "lr_decay": 0.1, "weight_decay": 0.0}  # fmt: skip
# dataset: (script, settings as parsed, what docs/datasets.md cites for them)
PAPER_SETTINGS = {
    # ANFR App. A.1 / Sec. 4.1: ResNet-50, Adam lr 5e-4 (AdamW without decay), batch 64, all clients, focal loss
    "isic": (
        "anfr.py",
        {
            "depth": 50,
            "lr": 5e-4,
            "weight_decay": 0.0,
            "batch_size": 64,
            "frac": 1.0,
            "loss": "focal",
            "balanced_acc": True,
            "natural": True,
        },
        "ANFR Tables 1, 2; App. A.1",
    ),  # fmt: skip
    # FedLN App. C.3 and Table 9: ResNet-18, SGD without momentum, batch 32; lr 0.001 for PACS, 0.01 otherwise
    "pacs": (
        "fedln.py",
        {"model": "resnet18", "lr": 0.001, "momentum": 0.0, "batch_size": 32, "clients_per_domain": 3},
        "FedLN Table 5",
    ),  # fmt: skip
    "tinyimagenet": (
        "fedln.py",
        {"model": "resnet18", "lr": 0.01, "momentum": 0.0, "batch_size": 32, "num_clients": 200},
        "FedLN Table 1",
    ),  # fmt: skip
    # FedBABU App. I (Table 19) and A.1: 3convNet, SGD lr 0.1 momentum 0.9, batch 50, f=0.1, tau=10
    "femnist": ("fedbabu.py", {**FEDBABU_EMNIST, "natural": True}, "FedBABU's for EMNIST"),
    "emnist": ("fedbabu.py", {**FEDBABU_EMNIST, "num_clients": 1488}, "Table 19"),
    # ANFR Table 3, App. A.1 (CelebA as its CIFAR-10 from ImageNet weights, Pieri et al.'s: SGD lr 0.03, batch 32,
    # 1 local epoch, clipping 1), nothing kept per client (9,343 of them)
    "celeba": (
        "anfr.py",
        {
            "depth": 50,
            "optimizer": "sgd",
            "lr": 0.03,
            "weight_decay": 0.0,
            "batch_size": 32,
            "local_epochs": 1,
            "clip": 1.0,
            "natural": True,
            "client_state": "reset",
            "image_size": 224,
            "augment": "rrc",
        },
        "ANFR Table 3",
    ),  # fmt: skip
}


def dataset_of(argv):
    """The real dataset a documented training command is for: --dataset tinyimagenet / emnist, or the image folder's
    name (~/isic, ~/isic224, ~/pacs, ~/femnist, ~/celeba); None for any other."""

    def value(flag):
        return argv[argv.index(flag) + 1] if flag in argv[:-1] else None

    if value("--dataset") in ("tinyimagenet", "emnist"):
        return value("--dataset")
    name = os.path.basename((value("--data-dir") or "").rstrip("/"))
    return "isic" if re.fullmatch(r"isic\d*", name) else name if name in PAPER_SETTINGS else None


DATASET_COMMANDS = [
    (where, argv, dataset_of(argv))
    for where, argv in COMMANDS
    if argv[0] == "python" and argv[1] in {f"{m}.py" for m in METHODS} and dataset_of(argv)
]


@pytest.mark.parametrize("where, argv, dataset", DATASET_COMMANDS, ids=[w for w, _, _ in DATASET_COMMANDS])
def test_dataset_commands_use_the_papers_settings(where, argv, dataset, places, monkeypatch):
    script, settings, _ = PAPER_SETTINGS[dataset]
    assert argv[1] == script, f"{where}: {dataset} is trained with {script} in its paper's setting"
    monkeypatch.chdir(ROOT)
    args = parse(script, argv[2:], places, monkeypatch)
    got = {k: getattr(args, k) for k in settings}
    want = {k: pytest.approx(v) if isinstance(v, float) else v for k, v in settings.items()}  # (approx: flat only)
    assert got == want, f"{where}: {dataset}: {got} instead of {settings}"
    if dataset == "isic":  # App. A.1 (80 rounds of 200 steps, local weights) or B.2 (FLamby's: 9 of 100, pooled)
        assert (args.rounds, args.local_steps, args.focal_weights) in {(80, 200, "local"), (9, 100, "pooled")}, where
    if dataset == "celeba":  # 10 of LEAF's 9,343 clients a round; 30 rounds per client on average
        assert max(int(args.frac * 9343 + 1e-9), 1) == 10 and args.rounds == 30 * 9343 // 10, where


def test_every_dataset_has_its_command_and_its_source():
    """docs/datasets.md has a training command for each dataset and names the paper and table next to it; the
    README links it."""
    text = read("docs/datasets.md")
    found = {d for w, _, d in DATASET_COMMANDS if w.startswith("docs/datasets.md")}
    assert found == set(PAPER_SETTINGS), sorted(set(PAPER_SETTINGS) - found)
    for where, _, dataset in DATASET_COMMANDS:
        if where.startswith("docs/datasets.md"):
            line = int(where.split(":")[1])
            before = "\n".join(text.splitlines()[max(0, line - 16) : line])
            assert PAPER_SETTINGS[dataset][2] in before, f"{where}: the text above does not cite the paper's setting"
    assert "(docs/datasets.md)" in read("README.md")  # the README points to them


# ---------------------------------------------------------------------------------------------
# Links, anchors, tables, page shape
# ---------------------------------------------------------------------------------------------
def slug(heading):
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc):
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", read(doc)), re.M):
        s = slug(m.group(1))
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def links(doc):
    """Inline links and images, and the targets of reference definitions (`[label]: target`)."""
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", read(doc)))
    inline = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose)
    return inline + re.findall(r"^\[[^\]]+\]:\s*(\S+)", prose, re.M)


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_and_anchors_resolve(doc):
    base = os.path.dirname(os.path.join(ROOT, doc))
    targets = links(doc)
    for target in targets:
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(base, path)) if path else os.path.join(ROOT, doc)
        assert os.path.exists(full), f"{doc}: link to {target}: no such file"
        if anchor and full.endswith(".md"):
            assert anchor in anchors(os.path.relpath(full, ROOT)), f"{doc}: link to {target}: no such heading"


def test_every_docs_figure_is_shown():
    shown = {
        os.path.normpath(os.path.join(os.path.dirname(d), t)) for d in DOCS for t in links(d) if t.endswith(".png")
    }
    for png in glob.glob(os.path.join(ROOT, "docs", "*.png")):
        assert os.path.relpath(png, ROOT) in shown, f"{os.path.relpath(png, ROOT)} is not shown in any page"


@pytest.mark.parametrize("doc", DOCS)
def test_table_rows_have_the_header_cells(doc):
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), read(doc))
    header = None
    for n, line in enumerate(prose.splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = len(re.findall(r"(?<!\\)\|", line))
        if header is None:
            header = cells
        assert cells == header, f"{doc}:{n}: {cells - 1} cells, the header has {header - 1} (escape | as \\|)"


@pytest.mark.parametrize("method", METHODS)
def test_method_page_has_the_fixed_sections(method):
    doc = f"docs/{method}.md"
    text = FENCE.sub("", read(doc))
    assert re.match(r"# .*`%s\.py`" % method, text), f"{doc}: the title names {method}.py"
    assert re.findall(r"^## (.+)$", text, re.M) == SECTIONS
    assert f"(docs/{method}.md)" in read("README.md"), f"the README's scripts table links {doc}"
    # the first screen: the bottom line (a verdict), then Usage: --help, a one-minute run, the script's flags
    top = text.split("\n## Paper and idea", 1)[0]
    assert "**Bottom line**" in top and "(#results)" in top, f"{doc}: a bottom line linking Results above the idea"
    usage = read(doc).split("\n## Usage\n", 1)[1].split("\n## ", 1)[0]
    first = FENCE.search(usage).group(0).splitlines()[1:3]
    assert first[0] == f"python {method}.py --help", f"{doc}: Usage starts with `python {method}.py --help`"
    assert first[1].startswith(f"python {method}.py --dataset cifar10 --data-dir ./data "), f"{doc}: the README's route"
    assert read(doc).splitlines().index(first[1]) < 40, f"{doc}: the first run is on the first screen"
    assert "(#flags-beyond-fedavgpys)" in usage or "(flags.md)" in usage, f"{doc}: Usage points to the flags"
    # Results: one summary table, then one figure, then the experiments (### each) and the evidence pages
    results = read(doc).split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in results.split("\n\n") if b.strip()]
    kinds = ["table" if b.startswith("|") else "figure" if b.startswith("![") else "text" for b in blocks]
    assert kinds[:3] == ["text", "table", "figure"], f"{doc}: Results opens with its summary table and a figure"


# ---------------------------------------------------------------------------------------------
# Code pointers: `fedfn.py: fn_forward`, `common.py: accumulate, load_average`, `common.py: RunFolder.finish`,
# `fedbabu.py: the __main__ block`; names, never line numbers
# ---------------------------------------------------------------------------------------------
POINTER_ITEM = r"(?:the __main__ (?:loop|block)|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)"
POINTER = re.compile(r"(\w+)\.py: (%s(?:, %s)*)" % (POINTER_ITEM, POINTER_ITEM))


def defines(source, name):
    """Whether a script defines name at its top level (def, class, NAME = ...), or Class.method."""
    cls, _, attr = name.rpartition(".")
    if cls:
        body = re.search(r"^class %s\b.*?(?=^\S|\Z)" % cls, source, re.M | re.S)
        return body is not None and re.search(r"^\s+def %s\(" % attr, body.group(0), re.M) is not None
    return re.search(r"^(def %s\(|class %s\b|%s\s*[:=])" % (name, name, name), source, re.M) is not None


def test_code_pointers_name_definitions():
    """Every backticked `<script>.py: <name>[, <name>...]` in the docs (code blocks aside) names a script of
    the repository root that defines each name (`the __main__ loop` / `block`: it has one); each bullet of
    a method page's "Implementation details and deviations" points to its code so."""
    sources, found = {}, 0
    for doc in DOCS:
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), read(doc))
        for m in re.finditer(r"`([^`]+)`", prose):
            ptr = POINTER.fullmatch(" ".join(m.group(1).split()))
            if not ptr:
                continue
            found += 1
            line, script = prose[: m.start()].count("\n") + 1, ptr.group(1) + ".py"
            where = f"{doc}:{line}"
            assert os.path.isfile(os.path.join(ROOT, script)), f"{where}: `{m.group(1)}`: no {script}"
            if script not in sources:
                sources[script] = read(script)
            for name in re.findall(POINTER_ITEM, ptr.group(2)):
                if name.startswith("the __main__"):
                    assert 'if __name__ == "__main__":' in sources[script], f"{where}: {script} has no __main__"
                else:
                    assert defines(sources[script], name), f"{where}: `{m.group(1)}`: {script} defines no {name}"
    assert found >= 5 * len(METHODS)  # the pattern still finds the pointers
    for method in METHODS:
        text = FENCE.sub("", read(f"docs/{method}.md"))
        section = text.split("## Implementation details and deviations", 1)[1].split("\n## ", 1)[0]
        for bullet in re.findall(r"^- .*(?:\n(?!- )(?!\S).*)*", section, re.M):
            assert any(POINTER.fullmatch(" ".join(c.split())) for c in re.findall(r"`([^`]+)`", bullet)), (
                f"docs/{method}.md: this bullet has no `<script>.py: <name>` pointer: {bullet[:80]}..."
            )


def prose_lines(doc):
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), read(doc)).splitlines()


def test_readme_and_pages_read_at_a_glance():
    """Length limits: the README at most 1,500 words, no line of it over 120 characters outside code blocks
    (tables included), its Results one row per claim with cells of at most 100 characters, each linking its
    claim's page; every docs page, evidence pages included, at most 3,000 words."""
    readme = read("README.md")
    assert len(readme.split()) <= 1500, f"README: {len(readme.split())} words"
    wide = [(n, len(line)) for n, line in enumerate(prose_lines("README.md"), 1) if len(line) > 120]
    assert not wide, f"README lines over 120 characters (line, length): {wide}"
    table, targets = table_after("README.md", "Results"), reference_links("README.md")
    pages = [targets.get(row, "").split("#")[0] for row in table]
    assert sorted(pages) == sorted(f"docs/{m}.md" for m in CLAIM_PAGES), f"one row per claim, each its page: {pages}"
    for row, cells in table.items():
        for column, cell in cells.items():
            assert len(cell) <= 100, f"README Results {row}, {column}: {len(cell)} characters"
    for doc in DOCS[1:]:
        assert len(read(doc).split()) <= 3000, f"{doc}: {len(read(doc).split())} words"


def test_ci_runs_the_readme_test_command():
    """.ci/run runs exactly the README's test command (format, lint, tests), in its fresh virtual environment."""
    command = re.search(r"```bash\n(pip install -r requirements-dev\.txt [^\n]*)\n```", read("README.md")).group(1)
    assert "ruff format --check" in command and "ruff check" in command and "pytest" in command
    ci = read(".ci/run")
    code = [line.split("#")[0] for line in ci.splitlines() if not line.startswith("#!")]
    assert command in ci and any("python3 -m venv" in c for c in code)
    assert not any("--system-site-packages" in c for c in code)  # only what requirements-dev.txt installs


# ---------------------------------------------------------------------------------------------
# Figures the README repeats: each is checked against its one source (the runs in benchmarks/results, as
# benchmarks/collect.py reads them, and the docs pages' tables; tests/README.md's mutation runs)
# ---------------------------------------------------------------------------------------------
NUMBER = re.compile(r"\d+\.\d+")
FINAL, PERS, INIT, FT1 = "final test acc", "personalized (5 ft epochs)", "initial (0 ft epochs)", "after 1 ft epoch"
BEST_VAL, LAST5, QUARTER = (
    "test acc at best val (the paper's)",
    "mean of the last 5 evaluations",
    "test acc at 1/4 of the rounds",
)
GAIN = "mean |last gain|"


# Where a shown number comes from. Each helper returns one source; a cell lists one per decimal number, in order.
def mean(claim, scale, variant, metric=FINAL, kind="runs"):  # kind runs-h200: benchmarks/results-h200
    """The mean over the seeds (%) of the runs in benchmarks/results/<claim>-<scale>/<variant>/, as collect.py reads
    them for the docs tables."""
    return ("mean", kind, claim, scale, variant, metric)


def std(claim, scale, variant, metric=FINAL, kind="runs"):
    return ("std", kind, claim, scale, variant, metric)


def diff(a, b):
    return ("diff", a, b)


def low(claim, scale, variants, metric=GAIN):  # the smallest per-run value (as logged, not in %) over the variants
    return ("min", "runs", claim, scale, tuple(variants), metric)


def high(claim, scale, variants, metric=GAIN):
    return ("max", "runs", claim, scale, tuple(variants), metric)


def paper(claim, variant, metric=FINAL):  # the paper's number as collect.py tables it beside the variant
    return ("paper", claim, variant, metric)


def quoted(page):  # a number quoted from the paper that collect.py does not table: it stands in that page
    return ("text", page)


def note(claim):  # a number of collect.py's note for the claim (the paper's, quoted there)
    return ("note", claim)


ARCHS = ("anfr", "bn", "gn", "se", "nf")  # the pages' order: ANFR first, then the baselines


def each(source, *variants):
    """The same source for several variants, in order: each(lambda v: mean("fedln", "small", v), "ln", "fn")."""
    return [source(v) for v in variants]


@functools.lru_cache(maxsize=None)
def found_runs(kind):
    import collect

    return collect.gather(os.path.join(ROOT, "benchmarks", {"runs": "results", "runs-h200": "results-h200"}[kind]))


def run_values(kind, claim, scale, variant, metric):
    import collect

    _, how, _ = next(m for m in collect.CLAIMS[claim]["metrics"] if m[0] == metric)
    runs = [r for r in found_runs(kind)[(claim, scale)][variant]["runs"] if not r["summary"].get("diverged")]
    assert runs, f"no finished run of {claim}-{scale}/{variant}"
    return [collect.value(r, how) for r in runs]


def source_value(source):
    """The value a source gives, in the unit the docs show it (% for accuracies); None for a quoted number."""
    import collect

    kind = source[0]
    if kind == "diff":
        return source_value(source[1]) - source_value(source[2])
    if kind in ("mean", "std"):
        m, s, _ = collect.mean_std(run_values(*source[1:]))
        return 100 * (m if kind == "mean" else s)
    if kind in ("min", "max"):
        _, root, claim, scale, variants, metric = source
        values = [v for variant in variants for v in run_values(root, claim, scale, variant, metric)]
        return min(values) if kind == "min" else max(values)
    return None


def check_number(where, shown, source):
    """shown (a string as the docs print it) is what its source gives, to the digits shown."""
    import collect

    kind = source[0]
    if kind == "paper":
        _, claim, variant, metric = source
        papers = next(m for m in collect.CLAIMS[claim]["metrics"] if m[0] == metric)[2]
        assert shown in NUMBER.findall(papers[variant]), f"{where}: the paper's {variant} is {papers[variant]}"
    elif kind == "text":
        assert shown in read(source[1]), f"{where}: {shown} is not in {source[1]}"
    elif kind == "note":
        assert shown in NUMBER.findall(collect.CLAIMS[source[1]]["note"]), f"{where}: not in collect.py's note"
    else:
        value, digits = source_value(source), len(shown.split(".")[1])
        assert abs(float(shown) - value) <= 0.5 * 10**-digits + 1e-9, f"{where}: the runs give {value:.4f}"


def check_cells(where, cells, sources):
    """Every decimal number of each cell (the row's label aside) against its sources, in order; returns how many
    were results of ours (runs, not the paper's)."""
    checked = 0
    for column, cell in list(cells.items())[1:]:
        numbers, want = NUMBER.findall(cell), sources.get(column, [])
        assert len(numbers) == len(want), f"{where}, {column}: {numbers} but sources {want}"
        for shown, source in zip(numbers, want):
            check_number(f"{where}, {column}: {shown}", shown, source)
            checked += source[0] not in ("paper", "text", "note")
    return checked


def table_after(doc, heading):
    """The first table under `## heading` of doc: {row label: {column: cell}}, split at unescaped pipes; a label
    that is a link keeps its text only."""
    section = read(doc).split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = ("|" + section.split("\n\n|", 1)[1].split("\n\n", 1)[0]).splitlines()
    lines = [line for line in rows if not re.match(r"\|\s*-", line)]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]

    def label(c):
        return re.sub(r"^\[([^\]]+)\](\[[^\]]*\]|\([^)]*\))?$", r"\1", c)

    return {label(row[0]): dict(zip(cells[0], row)) for row in cells[1:]}


def reference_links(doc):
    return dict(re.findall(r"^\[([^\]]+)\]:\s*(\S+)", FENCE.sub("", read(doc)), re.M))


# README "Results": one row per claim (its label) -> column -> where each decimal number of the cell comes from
SMALL, PROXY, PAPER_SCALE = "small (CPU)", "proxy (CPU)", "paper scale"
RESULTS_SOURCES = {
    "FedFN > FedAvg, s=2": {
        "paper": each(lambda v: paper("fedfn-s2", v), "fedfn", "fedavg"),
        SMALL: each(lambda v: mean("fedfn-s2", "small", v), "fedfn", "fedavg"),
        PROXY: each(lambda v: mean("fedfn-s2", "proxy", v), "fedfn", "fedavg"),
    },
    "FedBABU > FedAvg": {
        "paper": each(lambda v: paper("fedbabu", v, PERS), "fedbabu", "fedavg"),
        SMALL: each(lambda v: mean("fedbabu", "small", v, PERS), "fedbabu", "fedavg"),
        PROXY: each(lambda v: mean("fedbabu", "proxy", v, PERS), "fedbabu", "fedavg"),
        PAPER_SCALE: each(lambda v: mean("fedbabu", "paper", v, PERS, kind="runs-h200"), "fedbabu", "fedavg"),
    },
    "LN / FN > FedAvg": {
        "paper": each(lambda v: paper("fedln", v), "ln", "fn", "vanilla"),
        SMALL: each(lambda v: mean("fedln", "small", v), "ln", "fn", "vanilla"),
    },
    "FedNNNN > FedAvg": {
        "paper": each(lambda v: paper("fednnnn", v), "fednnnn", "fedavg"),
        SMALL: each(lambda v: mean("fednnnn", "small", v), "fednnnn", "fedavg"),
    },
    "ANFR > BN-ResNet": {
        "paper": each(lambda v: paper("anfr-cropflip", v, BEST_VAL), "anfr", "bn"),
        SMALL: each(lambda v: mean("anfr-cropflip", "small", v, BEST_VAL), "anfr", "bn"),
        PROXY: each(lambda v: mean("anfr-cropflip", "proxy", v, BEST_VAL), "anfr", "bn"),
    },
}
CLAIM_PAGES = {"fedfn", "fedbabu", "fedln", "fednnnn", "anfr"}

# Each method page's Results summary table (the first table under "## Results"): row label -> column -> sources
H200, CPU2 = "paper scale, H200 (3 seeds)", "paper scale, CPU (2 seeds)"
CROP, RRC = "anfr-cropflip", "anfr-rrc"
SUMMARY_SOURCES = {
    "fedfn": {
        **{
            f"s={s} shards (T1)": {
                "paper": each(lambda v: paper(f"fedfn-s{s}", v), "fedfn", "fedavg"),
                SMALL: each(lambda v: mean(f"fedfn-s{s}", "small", v), "fedfn", "fedavg"),
                PROXY: each(lambda v: mean(f"fedfn-s{s}", "proxy", v), "fedfn", "fedavg"),
            }
            for s in (2, 10)
        },
        "Dirichlet alpha 0.1, E=2 (T8, E=15)": {
            "paper": each(lambda v: paper("fedfn-a0.1", v), "fedfn", "fedavg"),
            PROXY: each(lambda v: mean("fedfn-a0.1", "proxy", v), "fedfn", "fedavg"),
        },
        "Dirichlet alpha 0.1, E=5": {
            "paper": each(lambda v: paper("fedfn-a0.1", v), "fedfn", "fedavg"),
            PROXY: each(lambda v: mean("fedfn-a0.1", "proxy", v), "fedfn-e5", "fedavg-e5"),
        },
        "Dirichlet alpha 0.5, E=2 (T8, E=15)": {
            "paper": each(lambda v: paper("fedfn-a0.5", v), "fedfn", "fedavg"),
            PROXY: each(lambda v: mean("fedfn-a0.5", "proxy", v), "fedfn", "fedavg"),
        },
        "control: FN scaled to sqrt(d), lr 0.01": {
            SMALL: [mean("fedfn-s2", "small", "fedfn-sqrtd"), mean("fedfn-s10", "small", "fedfn-sqrtd")],
        },
    },
    "fedbabu": {
        f"{name} (T{table})": {
            "paper": each(lambda v: paper("fedbabu", v, metric), "fedbabu", "fedavg"),
            SMALL: each(lambda v: mean("fedbabu", "small", v, metric), "fedbabu", "fedavg"),
            PROXY: each(lambda v: mean("fedbabu", "proxy", v, metric), "fedbabu", "fedavg"),
            H200: each(lambda v: mean("fedbabu", "paper", v, metric, kind="runs-h200"), "fedbabu", "fedavg"),
            CPU2: each(lambda v: mean("fedbabu", "paper", v, metric), "fedbabu", "fedavg"),
        }
        for name, table, metric in (("personalized, 5 ft epochs", 13, PERS), ("initial, 0 ft epochs", 12, INIT))
    }
    | {
        "after 1 ft epoch (T6: CIFAR-100 only)": {
            SMALL: each(lambda v: mean("fedbabu", "small", v, FT1), "fedbabu", "fedavg"),
            PROXY: each(lambda v: mean("fedbabu", "proxy", v, FT1), "fedbabu", "fedavg"),
            H200: each(lambda v: mean("fedbabu", "paper", v, FT1, kind="runs-h200"), "fedbabu", "fedavg"),
            CPU2: each(lambda v: mean("fedbabu", "paper", v, FT1), "fedbabu", "fedavg"),
        }
    },
    "fedln": {
        label: {"paper": [paper("fedln", v)] * papers, SMALL: [mean("fedln", "small", v), std("fedln", "small", v)]}
        for label, v, papers in (
            ("ln (layer norm after each activation)", "ln", 2),
            ("fn (the last feature scaled to sqrt(d))", "fn", 2),
            ("vanilla (`--norm none`)", "vanilla", 2),
            ("bn (batch norm, statistics averaged)", "bn", 1),
        )
    },
    "fednnnn": {
        label: {
            "paper": [paper("fednnnn", v)],
            "small (CPU), final round": [mean("fednnnn", "small", v), std("fednnnn", "small", v)],
            "mean of the last 5 evaluations": [mean("fednnnn", "small", v, LAST5), std("fednnnn", "small", v, LAST5)],
            "at 1/4 of the rounds": [mean("fednnnn", "small", v, QUARTER), std("fednnnn", "small", v, QUARTER)],
        }
        for label, v in (
            ("fedavg", "fedavg"),
            ("normnorm (`--beta 0.6 --gamma 0`)", "normnorm"),
            ("momentum (`--no-normalize --beta 1 --gamma 0.9`)", "momentum"),
            ("fednnnn", "fednnnn"),
        )
    },
    "anfr": {
        "FedAvg": {
            "paper": each(lambda v: paper(CROP, v, BEST_VAL), *ARCHS),
            SMALL: each(lambda v: mean(CROP, "small", v, BEST_VAL), *ARCHS),
            PROXY: each(lambda v: mean(CROP, "proxy", v, BEST_VAL), *ARCHS),
        },
        "FedAvg, the recipe's random-resized crops (ANFR / BN)": {
            "paper": each(lambda v: paper(RRC, v, BEST_VAL), "anfr", "bn"),
            PROXY: each(lambda v: mean(RRC, "proxy", v, BEST_VAL), "anfr", "bn"),
        },
        "central: one client, the same steps (Table 9's second column)": {
            "paper": [quoted("docs/evidence/anfr.md")] * 5,
            SMALL: each(lambda v: mean(CROP, "small", f"{v}-central", BEST_VAL), *ARCHS),
            PROXY: each(lambda v: mean(CROP, "proxy", f"{v}-central", BEST_VAL), *ARCHS),
        },
        "federation's cost, central - FedAvg (ANFR / BN)": {
            "paper": [quoted("docs/evidence/anfr.md")] * 2,
            **{
                column: each(
                    lambda v: diff(mean(CROP, scale, f"{v}-central", BEST_VAL), mean(CROP, scale, v, BEST_VAL)),
                    "anfr",
                    "bn",
                )
                for column, scale in ((SMALL, "small"), (PROXY, "proxy"))
            },
        },
        "earlier comparison: PyTorch's init, final round": {
            "paper": each(lambda v: paper("anfr", v), *ARCHS),
            SMALL: each(lambda v: mean("anfr", "small", v), *ARCHS),
            PROXY: each(lambda v: mean("anfr", "proxy", v), *ARCHS),
        },
    },
    "fedavg": {  # FedAvg as each claim's baseline
        "FedFN, s=2 shards (T1)": {
            "paper's FedAvg": [paper("fedfn-s2", "fedavg")],
            SMALL: [mean("fedfn-s2", "small", "fedavg")],
            PROXY: [mean("fedfn-s2", "proxy", "fedavg")],
        },
        "FedBABU, personalized (T13)": {
            "paper's FedAvg": [paper("fedbabu", "fedavg", PERS)],
            SMALL: [mean("fedbabu", "small", "fedavg", PERS)],
            PROXY: [mean("fedbabu", "proxy", "fedavg", PERS)],
            PAPER_SCALE: [mean("fedbabu", "paper", "fedavg", PERS, kind="runs-h200")],
        },
        "FedLN, one class per client (T10)": {
            "paper's FedAvg": [paper("fedln", "vanilla")],
            SMALL: [mean("fedln", "small", "vanilla")],
        },
        "FedNNNN, non-IID-B (T2)": {
            "paper's FedAvg": [paper("fednnnn", "fedavg")],
            SMALL: [mean("fednnnn", "small", "fedavg")],
        },
        "ANFR, split-2, BN-ResNet (T9)": {
            "paper's FedAvg": [paper(CROP, "bn", BEST_VAL)],
            SMALL: [mean(CROP, "small", "bn", BEST_VAL)],
            PROXY: [mean(CROP, "proxy", "bn", BEST_VAL)],
        },
    },
}

# Numbers that stand in prose or in an experiment's table (many of them once in the README's Results cells): the
# page shows the number, and its source gives it
TIES = [
    ("README.md", "9.63", paper("fedln", "bn")),
    ("README.md", "9.2", mean("fedln", "small", "bn")),
    ("docs/fedbabu.md", "63.29", note("fedbabu")),  # Table 6, CIFAR-100: after 1 ft epoch
    ("docs/fedbabu.md", "27.43", note("fedbabu")),
    # FedFN at alpha 0.1, E=5: the gap on the final round and on the last five evaluations
    ("docs/fedfn.md", "60.09", mean("fedfn-a0.1", "proxy", "fedfn-e5", LAST5)),
    ("docs/fedfn.md", "60.62", mean("fedfn-a0.1", "proxy", "fedavg-e5", LAST5)),
    ("docs/fedfn.md", "1.70", diff(mean("fedfn-a0.1", "proxy", "fedavg-e5"), mean("fedfn-a0.1", "proxy", "fedfn-e5"))),
    ("docs/fedfn.md", "0.54", diff(*(mean("fedfn-a0.1", "proxy", v, LAST5) for v in ("fedavg-e5", "fedfn-e5")))),
    *[
        ("docs/fedfn.md", shown, mean(f"fedfn-a{a}", "proxy", v, LAST5))
        for shown, a, v in (("41.25", 0.1, "fedfn"), ("47.49", 0.1, "fedavg"), ("64.76", 0.5, "fedfn"))
    ],
    ("docs/fedfn.md", "62.29", mean("fedfn-a0.5", "proxy", "fedavg", LAST5)),
    # ANFR: gaps to BN under FedAvg and centrally, federation's cost, the gains' opening
    ("docs/anfr.md", "14.8", diff(mean(CROP, "small", "bn", BEST_VAL), mean(CROP, "small", "anfr", BEST_VAL))),
    ("docs/anfr.md", "10.73", diff(mean(CROP, "proxy", "bn", BEST_VAL), mean(CROP, "proxy", "anfr", BEST_VAL))),
    ("docs/anfr.md", "0.81", diff(mean(CROP, "proxy", "anfr", BEST_VAL), mean(CROP, "proxy", "nf", BEST_VAL))),
    ("docs/anfr.md", "8.26", diff(mean(RRC, "proxy", "bn", BEST_VAL), mean(RRC, "proxy", "anfr", BEST_VAL))),
    *[
        ("docs/anfr.md", shown, diff(*(mean(CROP, scale, f"{v}-{kind}", BEST_VAL) for v in ("bn", "anfr"))))
        for shown, scale, kind in (("10.67", "small", "central"), ("8.96", "proxy", "central"))
        + (("9.42", "small", "central-total"), ("7.46", "proxy", "central-total"))
    ],
    ("docs/anfr.md", "23.0", diff(mean("anfr", "small", "bn"), mean("anfr", "small", "anfr"))),
    ("docs/anfr.md", "0.04", low(CROP, "small", ("nf", "anfr"))),
    ("docs/anfr.md", "0.05", high(CROP, "small", ("nf", "anfr"))),
    ("docs/anfr.md", "0.19", low(CROP, "small", ("bn",))),
    ("docs/anfr.md", "0.20", high(CROP, "small", ("bn",))),
    ("docs/anfr.md", "0.09", low(CROP, "proxy", ("nf", "anfr"))),
    ("docs/anfr.md", "0.12", high(CROP, "proxy", ("nf", "anfr"))),
    ("docs/anfr.md", "0.26", low(CROP, "proxy", ("bn", "gn", "se"))),
    ("docs/anfr.md", "0.35", high(CROP, "proxy", ("bn", "gn", "se"))),
    ("docs/evidence/anfr-proxy.md", "72.05", mean(CROP, "proxy", "anfr-central-total", BEST_VAL)),
    ("docs/evidence/anfr-proxy.md", "79.51", mean(CROP, "proxy", "bn-central-total", BEST_VAL)),
]  # fmt: skip


def test_readme_results_are_the_runs_and_the_docs_tables():
    """Every decimal number of the README's Results table, cell by cell: a result of ours is the mean over the
    seeds of the runs in benchmarks/results (benchmarks/collect.py's reading, the docs tables' source) to the
    README's digits, and its page (the row's link) shows the same mean to two decimals; a paper's number is the one
    collect.py tables beside it."""
    table, targets = table_after("README.md", "Results"), reference_links("README.md")
    assert set(table) == set(RESULTS_SOURCES), "a row was added or renamed: say where its numbers come from"
    checked = 0
    for row, cells in table.items():
        checked += check_cells(f"README Results {row}", cells, RESULTS_SOURCES[row])
        page = read(targets[row].split("#")[0])
        for column, cell in list(cells.items())[1:]:
            for shown, source in zip(NUMBER.findall(cell), RESULTS_SOURCES[row].get(column, [])):
                if source[0] == "mean":
                    value = source_value(source)
                    two = {f"{value + d:.2f}" for d in (-1e-6, 0, 1e-6)}  # either way at a tie (x.xx5)
                    assert any(t in page for t in two), f"README {row}: {targets[row]} does not show {value:.2f}"
    assert checked == 19  # every result of ours in the table


@pytest.mark.parametrize("method", METHODS)
def test_results_summary_tables_are_the_runs(method):
    """Each method page's Results opens with one summary table; every decimal number in it is its runs' (or the
    paper's, as collect.py tables it)."""
    table = table_after(f"docs/{method}.md", "Results")
    assert set(table) == set(SUMMARY_SOURCES[method]), f"docs/{method}.md: a summary row was added or renamed"
    checked = sum(
        check_cells(f"docs/{method}.md Results {row}", cells, SUMMARY_SOURCES[method][row])
        for row, cells in table.items()
    )
    assert checked >= len(table)


@pytest.mark.parametrize("doc, shown, source", TIES, ids=[f"{d}:{s}" for d, s, _ in TIES])
def test_numbers_in_the_text_are_their_runs(doc, shown, source):
    assert re.search(r"(?<![\d.])%s(?![\d])" % re.escape(shown), read(doc)), f"{doc} does not show {shown}"
    check_number(f"{doc}: {shown}", shown, source)


def test_readme_mutation_figures_are_tests_readmes():
    """tests/README.md documents the mutmut runs (each run's total, its survivors listed in a table, both runs
    together) and the hand-made mutants; the README repeats the sum and the count of benchmarks/hand_mutants.py."""
    import hand_mutants

    doc = read("tests/README.md")
    runs = [(int(k), int(n)) for k, n in re.findall(r"\*\*(\d+) of (\d+) mutants killed\*\*", doc)]
    tables = re.findall(r"^\| mutant \| change \| why it is equivalent \|\n\|[- |]+\|\n((?:\|.*\n)+)", doc, re.M)
    listed = [sum(len(re.findall(r"`[^`]+`", row.split("|")[1])) for row in t.splitlines()) for t in tables]
    assert len(runs) == len(tables) == 2 and listed == [n - k for k, n in runs]  # every survivor explained
    both = re.search(r"Both runs together: \*\*(\d+) of (\d+) mutants killed, the (\d+) survivors equivalent\*\*", doc)
    killed, made, survivors = map(int, both.groups())
    assert (killed, made) == tuple(map(sum, zip(*runs))) and survivors == made - killed
    hand = re.search(r"(\d+)/(\d+) are killed", doc)
    assert int(hand[1]) == int(hand[2]) == len(hand_mutants.MUTANTS)
    readme = " ".join(read("README.md").split("\n## Tests and CI\n", 1)[1].split())
    m = re.search(
        r"(\d+) of (\d+) one-token mutants of the math killed, the (\d+) survivors equivalent; (\d+) of (\d+) hand",
        readme,
    )
    assert tuple(map(int, m.groups())) == (killed, made, survivors) + (len(hand_mutants.MUTANTS),) * 2


def test_readme_speed_figure_is_speed_mds():
    """The README's overhead bound is docs/speed.md's, and it holds for the medians of its table."""
    speed = read("docs/speed.md")
    table = speed.split("<!-- overhead:start -->", 1)[1].split("<!-- overhead:end -->", 1)[0]
    medians = [float(x) for x in re.findall(r"\*\*(\d+\.\d+)\*\*", table)]
    readme = " ".join(read("README.md").split())
    percent = int(re.search(r"every script is within (\d+)% of the same SGD steps centralized", readme).group(1))
    assert f"Every script is within {percent}% of the centralized loop" in " ".join(speed.split())
    assert len(medians) == len(METHODS) and max(abs(x - 1) for x in medians) <= percent / 100 + 1e-9


def test_speed_tables_are_their_runs():
    """The Flower evidence page's table is what vs_flower.py prints from its JSON, cell for cell, and the README's
    and speed.md's ratios are its; the threads evidence page's tables of the earlier defaults are threads.py's from
    theirs."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import threads
    import vs_flower

    speed, readme = " ".join(read("docs/speed.md").split()), " ".join(read("README.md").split())
    saved = results("vs_flower.json")
    args = argparse.Namespace(**saved["args"])
    made = vs_flower.table(saved["runs"], args.configs, args.rounds)
    ratio = next(row for row in made.splitlines() if row.startswith("| flower-equal")).split("|")[-2].strip()
    assert f"`fedavg.py` is {ratio} faster than Flower 1.42 at equal core use (two processes of one thread)" in readme
    floor = saved["floor_s"]  # compute_floor's seconds at 2 threads and 1, as the page quotes them
    default = next(row for row in made.splitlines() if row.startswith("| flower-default")).split("|")[-2].strip()
    assert f"was {default} faster a round than Flower 1.42 at its default and {ratio} at equal core use" in speed
    flower = " ".join(read("docs/evidence/flower.md").split())
    assert f"take {floor['2']:.2f} s at 2 threads and {floor['1']:.2f} s at one" in flower
    assert block("docs/evidence/flower.md", "vs_flower") == made.strip()
    saved = results("threads.json")  # the earlier default's idle rows, quoted on the evidence page
    made = threads.table(saved["runs"], argparse.Namespace(**{**saved["args"], "conditions": ["idle"]}))
    ratios = [float(row.split("|")[-3]) for row in made.splitlines()[2:]]
    assert f"{min(ratios):.2f}-{max(ratios):.2f}" in read("docs/evidence/threads.md")
    saved = results("threads-controls", "spin-counts.json")
    made = threads.table(saved["runs"], argparse.Namespace(**saved["args"]))
    assert block("docs/evidence/threads.md", "spin") == made.strip()


def test_threads_quota_table_is_its_runs():
    """The evidence page's CPU-limit table is the three JSONs' runs, cycle by cycle, and the ranges the pages quote
    (two threads against one at 1 CPU and at a quarter) are theirs."""
    lines, times = ["| CPU limit | way | threads | cycle 1 | cycle 2 | test acc |", "|---|---|---|---|---|---|"], {}
    for name, limit in [("quota-1cpu", "1"), ("quota-1.5cpu", "1.5"), ("quota-quarter-cpu", "0.25")]:
        with open(os.path.join(ROOT, "benchmarks", "results-cpu", "threads-controls", f"{name}.json")) as f:
            runs = json.load(f)["runs"]
        for way in dict.fromkeys(r["way"] for r in runs):
            rows = sorted((r for r in runs if r["way"] == way), key=lambda r: r["cycle"])
            cells = [limit, way, rows[0]["threads"], *(f"{r['s_per_round']:.2f}" for r in rows)]
            lines.append(f"| {' | '.join(map(str, cells))} | {rows[0]['test_acc']:.4f} |")
            if way != "torchrun 2x1":  # one process: its threads
                times.setdefault(limit, {}).setdefault(rows[0]["threads"], []).extend(r["s_per_round"] for r in rows)
    evidence = read("docs/evidence/threads.md")
    assert evidence.split("<!-- quota:start -->\n", 1)[1].split("\n<!-- quota:end -->", 1)[0] == "\n".join(lines)

    def span(xs):
        return f"{min(xs):.2f}-{max(xs):.2f}"

    text, speed = " ".join(evidence.split()), " ".join(read("docs/speed.md").split())
    one, quarter = times["1"], times["0.25"]
    assert f"At 1 CPU two threads took {span(one[2])} s a round against one thread's {span(one[1])}" in text
    assert f"at a quarter {span(quarter[2])} against {span(quarter[1])}" in text
    assert f"rounds took {span(one[1])} s at one thread, the default there, against {span(one[2])} at two" in speed
    assert all(a < b for a, b in zip(times["1.5"][2], times["1.5"][1]))  # 1.5 CPUs: two threads faster each cycle


def test_threads_torchrun_idle_tables_are_their_runs():
    """The evidence page's idle torchrun table is what threads.py prints from its JSON, its unequal-clients table is
    that JSON's runs cycle by cycle, and the ratios quoted (torchrun's fastest round over the default's) are theirs."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import threads

    controls = os.path.join(ROOT, "benchmarks", "results-cpu", "threads-controls")
    evidence = read("docs/evidence/torchrun-cpu.md")

    def block(name):
        return evidence.split(f"<!-- {name}:start -->\n", 1)[1].split(f"\n<!-- {name}:end -->", 1)[0]

    with open(os.path.join(controls, "torchrun-idle.json")) as f:
        saved = json.load(f)
    assert block("torchrun-idle") == threads.table(saved["runs"], argparse.Namespace(**saved["args"]))

    def fastest(runs, way, w):
        return min(r["s_per_round"] for r in runs if r["way"] == way and r["workload"] == w)

    ratios = sorted(fastest(saved["runs"], "torchrun 2x1", w) / fastest(saved["runs"], "default", w)
                    for w in saved["args"]["workloads"])  # fmt: skip
    with open(os.path.join(controls, "idle-unequal-clients.json")) as f:
        runs = json.load(f)["runs"]
    lines = ["| way | cycle 1 | cycle 2 | cycle 3 | cycle 4 | fastest | test acc |", "|---|---|---|---|---|---|---|"]
    for way in ("default", "torchrun 2x1"):
        times = [r["s_per_round"] for c in (1, 2, 3, 4) for r in runs if r["way"] == way and r["cycle"] == c]
        acc = {r["test_acc"] for r in runs if r["way"] == way}
        assert len(times) == 4 and len(acc) == 1
        lines.append(f"| {way} | {' | '.join(f'{x:.2f}' for x in times)} | {min(times):.2f} | {acc.pop():.4f} |")
    assert block("unequal-clients") == "\n".join(lines)
    unequal = fastest(runs, "torchrun 2x1", "fedavg-cnn-dirichlet") / fastest(runs, "default", "fedavg-cnn-dirichlet")
    text = " ".join(evidence.split())
    assert f"Idle, torchrun took {ratios[0]:.2f}-{ratios[-1]:.2f}x the default's time" in text
    assert f"torchrun's fastest round took {unequal:.2f}x the default's" in text


def test_threads_mlp_evidence_is_its_runs():
    """The MLP evidence page's whole-run and pages tables are their JSONs' runs, its levers table is what threads.py
    prints from theirs, and the ratios quoted there and in speed.md (over one thread's time, loaded; torchrun's idle)
    are theirs."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import threads

    controls, page = os.path.join(ROOT, "benchmarks", "results-cpu"), read("docs/evidence/threads-mlp.md")

    def block(name):
        return page.split(f"<!-- {name}:start -->\n", 1)[1].split(f"\n<!-- {name}:end -->", 1)[0]

    def load(name):
        return json.load(open(os.path.join(controls, name)))

    runs = load("threads-controls/first-run-wall.json")["runs"]
    lines, said = ["| condition | default | 1 thread | default / 1 thread |", "|---|---|---|---|"], {}
    key, text = lambda r: (r["condition"], r["way"], r["cycle"]), " ".join(page.split())
    for condition in ("idle", "loaded"):
        wall = {
            w: [r["wall_s"] for c in (1, 2) for r in runs if key(r) == (condition, w, c)]
            for w in ("default", "1 thread")
        }
        ratios = sorted(d / t for d, t in zip(*wall.values()))
        cells = [", ".join(f"{x:.1f}" for x in wall[w]) for w in wall]
        lines.append(f"| {condition} | {' | '.join(cells)} | {ratios[0]:.2f}-{ratios[-1]:.2f} |")
        said[condition] = f"{ratios[0]:.2f}-{ratios[-1]:.2f}x"
    assert block("first-run-wall") == "\n".join(lines)
    assert f"took {said['loaded']} one thread's wall time loaded and {said['idle']} idle" in text
    pages = load("threads-controls/pages-loaded-wall.json")["runs"]
    wall = {(r["page"], r["way"]): r["wall_s"] for r in pages}
    names = ("fedbabu", "fedfn", "fedln", "fednnnn", "anfr")
    ratios = [wall[p, "default"] / wall[p, "1 thread"] for p in names]
    lines = ["| page | default | 1 thread | default / 1 thread |", "|---|---|---|---|"]
    lines += [
        f"| {p} | {wall[p, 'default']:.1f} | {wall[p, '1 thread']:.1f} | {x:.2f} |" for p, x in zip(names, ratios)
    ]
    assert len(pages) == 10 and block("pages-loaded-wall") == "\n".join(lines)
    assert f"by {round(100 * min(ratios) - 100)}-{round(100 * max(ratios) - 100)}% in this one cycle" in text
    idle, loaded = load("threads-controls/mlp-levers-idle.json"), load("threads-controls/mlp-levers-loaded.json")
    shown = [threads.table(x["runs"], argparse.Namespace(**x["args"])).splitlines() for x in (idle, loaded)]
    assert block("mlp-levers") == "\n".join([*shown[0], shown[1][2]]) and shown[0][0] == shown[1][0]
    mlp = load("threads-mlp.json")

    def median(x, way, c):
        return statistics.median(r["s_per_round"] for r in x["runs"] if (r["way"], r["condition"]) == (way, c))

    def fastest(x, way):
        return min(r["s_per_round"] for r in x["runs"] if r["way"] == way and r["condition"] == "idle")

    def over_one(x, way):
        return median(x, way, "loaded") / median(x, "1 thread", "loaded")

    assert f"two threads took {over_one(loaded, 'default'):.2f}-{over_one(mlp, 'default'):.2f}x one thread's" in text
    assert f"passive waiting {over_one(loaded, 'default GOMP_SPINCOUNT=0'):.2f}x" in text
    assert f"no pinning {over_one(loaded, 'default CLEANFL_NOPIN=1'):.2f}x" in text
    torchrun = sorted(over_one(x, "torchrun 2x1") for x in (loaded, mlp))
    assert f"took {torchrun[0]:.2f}-{torchrun[1]:.2f}x one thread's time there" in text
    on_idle = sorted(fastest(x, "torchrun 2x1") / fastest(x, "default") for x in (idle, mlp))
    assert f"idle {on_idle[0]:.2f}-{on_idle[1]:.2f}x the default's" in text
    pooled = [
        r["s_per_round"] for r in mlp["runs"] if r["condition"] == "loaded" and r["way"] in ("default", "2 threads")
    ]
    two, one = statistics.median(pooled), median(mlp, "1 thread", "loaded")  # --threads 2 is the default's code path
    assert len(pooled) == 8 and f"median of {two:.2f} s/round against one thread's {one:.2f}: {two / one:.2f}x" in text


def test_threads_busy_host_table_is_its_runs():
    """The evidence page's table of a run in a cgroup of its own beside a busy host is the four JSONs' runs, cycle
    by cycle, with each cycle's two-thread time over its one-thread time; the figures quoted from it and the
    candidates' times (passive waiting, torchrun) are their JSONs'."""
    lines = ["| the run's cgroup | CPU limit | 2 threads | 1 thread | 2 threads / 1 thread |", "|---|---|---|---|---|"]
    lost = []
    for name, where, limit in [("root", "root (the busy processes')", "none"), ("cgroup-nolimit", "a child", "none"),
                               ("cgroup-1.5cpu", "a child", "1.5"), ("cgroup-1cpu", "a child", "1")]:  # fmt: skip
        with open(os.path.join(ROOT, "benchmarks", "results-cpu", "threads-controls", f"busy-host-{name}.json")) as f:
            runs = json.load(f)["runs"]
        by = {
            way: [r for c in (1, 2) for r in runs if r["way"] == way and r["cycle"] == c]
            for way in ("default", "1 thread")
        }
        assert [r["threads"] for r in by["default"] + by["1 thread"]] == [2, 2, 1, 1]
        two, one = ([r["s_per_round"] for r in by[way]] for way in ("default", "1 thread"))
        ratios = sorted(a / b for a, b in zip(two, one))
        cells = [where, limit, ", ".join(f"{x:.2f}" for x in two), ", ".join(f"{x:.2f}" for x in one)]
        lines.append(f"| {' | '.join(cells)} | {ratios[0]:.2f}-{ratios[-1]:.2f} |")
        if name == "cgroup-nolimit":
            lost = ratios
    evidence = read("docs/evidence/threads.md")
    said = f"in a cgroup of their own, {min(lost):.2f}-{max(lost):.2f}x with no limit"
    assert said in " ".join(evidence.split())
    with open(
        os.path.join(ROOT, "benchmarks", "results-cpu", "threads-controls", "busy-host-cgroup-candidates.json")
    ) as f:
        runs = json.load(f)["runs"]

    def cycles(way):
        return [r for c in (1, 2) for r in runs if r["way"] == way and r["cycle"] == c]

    ways = ("default", "default GOMP_SPINCOUNT=0", "1 thread", "torchrun 2x1")
    times = {way: " and ".join(f"{r['s_per_round']:.2f}" for r in cycles(way)) for way in ways}
    text = " ".join(evidence.split())
    assert f"the default {times['default']} s, the default with `GOMP_SPINCOUNT=0`" in text
    assert (
        f"(threads that wait sleep at once) {times['default GOMP_SPINCOUNT=0']}, one thread {times['1 thread']}" in text
    )
    assert f"(one thread a process) {times['torchrun 2x1']}. Neither" in text
    assert evidence.split("<!-- busy-host:start -->\n", 1)[1].split("\n<!-- busy-host:end -->", 1)[0] == "\n".join(
        lines
    )


def test_threads_drift_table_is_its_run():
    """The evidence page's drift table is idle-drift.json's rounds (fastest, median, slowest, their ratio; steal
    ticks at 100 a second), and the one-thread spreads the pages quote are its one-thread runs'."""
    with open(os.path.join(ROOT, "benchmarks", "results-cpu", "threads-controls", "idle-drift.json")) as f:
        runs = json.load(f)
    lines = ["| cycle | way | threads | fastest round | median | slowest | slowest / fastest | steal time, s |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in runs:
        s = r["round_s"]
        cells = [min(s), statistics.median(s), max(s), max(s) / min(s), r["steal_ticks"] / 100]
        lines.append(f"| {r['cycle']} | {r['way']} | {r['threads']} | " + " | ".join(f"{x:.2f}" for x in cells) + " |")
    evidence = read("docs/evidence/threads.md")
    assert evidence.split("<!-- drift:start -->\n", 1)[1].split("\n<!-- drift:end -->", 1)[0] == "\n".join(lines)
    one = [r["round_s"] for r in runs if r["threads"] == 1]
    spreads = sorted(max(s) / min(s) for s in one)
    widest = max(one, key=lambda s: max(s) / min(s))
    text = " ".join(evidence.split())
    assert f"spread by {spreads[0]:.2f}-{spreads[-1]:.2f}x" in text
    assert f"at most {max(r['steal_ticks'] for r in runs) / 100:.2f} s" in text
    accs = {t: {r["test_acc"] for r in runs if r["threads"] == t} for t in (1, 2)}
    assert all(len(a) == 1 for a in accs.values())  # each run reached its twin's accuracy
    assert f"({min(accs[1]):.4f} at one thread, {min(accs[2]):.4f} at two)" in text
    assert f"rounds of the same work took {min(widest):.2f}-{max(widest):.2f} s" in text


def test_one_minute_runs_are_their_measured_runs():
    """Each page's one-minute run and the README's first run, and its torchrun line, quote the times (idle, beside two
    busy processes) and the accuracy of benchmarks/first_runs.py's runs (benchmarks/results-cpu/first-runs.json) at
    the CPU default, one process of the cores' threads (torchrun: two of one), whose accuracy is the same idle and
    loaded (the threads are the machine's, whatever its load)."""
    saved = json.load(open(os.path.join(ROOT, "benchmarks", "results-cpu", "first-runs.json")))
    by = {(r["page"], r["condition"]): r for r in saved["runs"]}

    def pct(x):
        return f"{100 * x:.2f}%"

    for page in METHODS:
        idle, loaded = (
            by["readme" if page == "fedavg" else page, "idle"],
            by["readme" if page == "fedavg" else page, "loaded"],
        )
        assert idle["processes"] == loaded["processes"] == 1 and idle["threads"] == loaded["threads"] == 2
        assert idle["test_acc"] == loaded["test_acc"]
        if page == "fedbabu":
            accs = (
                f"per-client accuracy {pct(idle['init_acc_mean'])} before fine-tuning and {pct(idle['pers_acc_mean'])}"
            )
        else:
            accs = f"final test accuracy {pct(idle['test_acc'])}"
        said = f"{idle['wall_s']:.0f} s idle and {loaded['wall_s']:.0f} s beside two busy processes, {accs}"
        assert said in " ".join(read(f"docs/{page}.md").split()), f"docs/{page}.md: {said}"
    readme = " ".join(read("README.md").split())
    idle, loaded = by["readme", "idle"], by["readme", "loaded"]
    said = f"it took {idle['wall_s']:.0f} s after the download, ending at {pct(idle['test_acc'])} (chance: 10%); beside"
    assert f"{said} two busy processes, {loaded['wall_s']:.0f} s" in readme
    idle, loaded = by["readme-torchrun", "idle"], by["readme-torchrun", "loaded"]
    assert (
        idle["processes"] == loaded["processes"] == 2
        and idle["threads"] == 1
        and idle["test_acc"] == loaded["test_acc"]
    )
    said = f"{idle['wall_s']:.0f} s idle and {loaded['wall_s']:.0f} s beside two busy processes, ending at "
    said += pct(idle["test_acc"])
    assert said in readme
    assert saved["measured"].split(", ", 1)[1].startswith("cpu (AMD EPYC, 2 cores")


def block(doc, name):
    """The text between a page's <!-- name:start --> and <!-- name:end --> markers."""
    return read(doc).split(f"<!-- {name}:start -->\n", 1)[1].split(f"\n<!-- {name}:end -->", 1)[0].strip()


def results(*parts):
    with open(os.path.join(ROOT, "benchmarks", "results-cpu", *parts)) as f:
        return json.load(f)


def test_cpu_speed_tables_are_their_runs():
    """docs/speed.md's tables of the CPU default, memory, image layout, per-client overhead and pfl-research, and the
    spin-count evidence page's, are what their benchmarks print from the JSONs they wrote, cell for cell."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import layout
    import memory
    import profile_round
    import threads
    import vs_pfl

    saved = results("cpu-default.json")
    assert block("docs/speed.md", "threads-final") == threads.bounds(saved["runs"], argparse.Namespace(**saved["args"]))
    for name in ("levers", "spins", "mlp-spins", "spin-at-start"):
        saved = results("threads-controls", f"{name}.json")
        made = threads.bounds(saved["runs"], argparse.Namespace(**saved["args"]))
        assert block("docs/evidence/threads-spin.md", name) == made, name
    saved = results("memory-cpu-build.json")
    assert block("docs/speed.md", "memory-cpu-build") == memory.table(saved["runs"], saved["torch_alone_bytes"])
    assert block("docs/speed.md", "layout") == layout.table(results("layout.json")["rows"])
    for name in ("profile-before", "profile-after"):
        assert block("docs/evidence/profile.md", name) == profile_round.table(results(f"{name}.json")), name
    for name in ("vs_pfl-idle", "vs_pfl-loaded"):
        saved = results(f"{name}.json")
        made = vs_pfl.table(saved["runs"], saved["args"]["configs"], saved["args"]["rounds"])
        assert block("docs/speed.md", name) == made, name


def test_cpu_speed_bottom_lines_are_their_tables():
    """The bottom lines of docs/speed.md's CPU sections and the README's figures are their tables' numbers."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import threads

    speed, readme = " ".join(read("docs/speed.md").split()), " ".join(read("README.md").split())
    saved = results("cpu-default.json")
    rows = [line.split("|") for line in threads.bounds(saved["runs"], argparse.Namespace(**saved["args"])).splitlines()]
    ratio = {(r[1].strip(), r[2].strip()): float(r[-3]) for r in rows[2:]}

    def span(*keys):
        values = [ratio[k] for k in keys]
        return f"{min(values):.2f}-{max(values):.2f}"

    idle = span(("fedavg-mlp", "idle"), ("fedavg-cnn", "idle"))
    loaded = span(("fedavg-mlp", "loaded"), ("fedavg-cnn", "loaded"))
    sweep_cnn, sweep_mlp = ratio["fedavg-cnn", "sweep"], ratio["fedavg-mlp", "sweep"]
    said = (
        f"{idle}x the fastest one-process setting idle (the bound: 1.1x) and {loaded}x one thread beside a busy "
        f"process on each core (the bound: 1.5x); in a sweep of two runs at once it is {sweep_cnn:.2f}x one thread's "
        f"time on McMahan's CNN and {sweep_mlp:.2f}x on the README's MLP"
    )
    assert said in speed
    # The CNN within every bound, the MLP within the idle one only, as the bottom line says.
    bound = {"idle": 1.1, "loaded": 1.5, "sweep": 1.3}
    met = {k: ratio[k] <= bound[k[1]] for k in ratio}
    assert all(met[k] for k in met if k[0] == "fedavg-cnn") and met["fedavg-mlp", "idle"]
    assert not met["fedavg-mlp", "loaded"] and not met["fedavg-mlp", "sweep"]
    assert "The CNN meets every bound; the MLP, all of whose operations are small, meets the idle one only" in speed
    said = f"idle {idle}x the fastest one-process setting, beside a busy process on each core {loaded}x one thread"
    assert said in readme


def test_the_spin_evidence_bottom_line_is_its_tables():
    """threads-spin.md's bottom line: a long spin (3,000, 10,000) within 1.1x of the fastest idle and 2.4-5.2x one
    thread in the sweep; a short one (100, none) 1.6-1.8x the fastest idle; on the MLP, over every control JSON."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import threads

    idle, sweep = {}, {}
    for name in ("levers", "spins", "mlp-spins"):
        saved = results("threads-controls", f"{name}.json")
        lines = threads.bounds(saved["runs"], argparse.Namespace(**saved["args"])).splitlines()
        ways = [w.strip() for w in lines[0].split("|")[3:-3]]
        for line in lines[2:]:
            cells = line.split("|")
            if cells[1].strip() != "fedavg-mlp":
                continue
            secs = dict(zip(ways, (float(c) for c in cells[3:-3])))
            # The scripts' spin then was 10,000: "default" is that.
            spins = {"default": 10000, "default GOMP_SPINCOUNT=3000": 3000, "default GOMP_SPINCOUNT=1000": 1000}
            spins.update({"default GOMP_SPINCOUNT=100": 100, "default GOMP_SPINCOUNT=0": 0})
            table = idle if cells[2].strip() == "idle" else sweep if cells[2].strip() == "sweep" else None
            if table is None:
                continue
            for way, spin in spins.items():
                if way in secs:
                    table.setdefault(spin, []).append(
                        (secs[way], secs["1 thread"], min(secs[w] for w in secs if not w.startswith("torchrun")))
                    )
    long_sweep = [s / o for spin in (3000, 10000) for s, o, _ in sweep[spin]]
    short_idle = [s / f for spin in (100, 0) for s, _, f in idle[spin]]
    text = " ".join(read("docs/evidence/threads-spin.md").split())
    assert f"is {min(long_sweep):.1f}-{max(long_sweep):.1f}x one thread in a sweep" in text
    assert f"is {min(short_idle):.1f}-{max(short_idle):.1f}x the fastest idle" in text
    assert all(s / f <= 1.1 for spin in (3000, 10000) for s, _, f in idle[spin])


def test_fednnnn_before_and_after_are_their_runs():
    """The profile page's FedNNNN figures (the fastest round of each way, before and after) and speed.md's ratio are
    the two JSONs'."""

    def fastest(name, way):
        runs = results(f"fednnnn-{name}.json")["runs"]
        return min(r["s_per_round"] for r in runs if r["way"] == way)

    one = fastest("after", "1 thread") / fastest("before", "1 thread")
    page = " ".join(read("docs/evidence/profile.md").split())
    said = f"at one thread {fastest('after', '1 thread'):.2f} s a round against {fastest('before', '1 thread'):.2f}"
    assert f"{said} ({one:.2f}x the time)" in page
    default = fastest("after", "default") / fastest("before", "default")
    said = f"at the default {fastest('after', 'default'):.2f} s against {fastest('before', 'default'):.2f}"
    assert f"{said} ({default:.2f}x)" in page
    assert f"FedNNNN's loop, of the same structure, takes {one:.2f}x the time" in " ".join(
        read("docs/speed.md").split()
    )


def test_pfl_bottom_line_is_its_tables():
    """speed.md's pfl-research bottom line: the twins' ratios (pfl / CleanFL of the median s/round) idle and loaded,
    pfl's own default against the scripts', and both sides' accuracies, from the two JSONs."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import vs_pfl

    def ratios(name):
        runs = results(f"vs_pfl-{name}.json")["runs"]
        median = {c: statistics.median(r["round_s"] for r in runs if r["config"] == c) for c in vs_pfl.CONFIGS}
        return {c: median[c] / median[twin] for c, twin in vs_pfl.TWIN.items()}, runs

    (idle, runs), (loaded, _) = ratios("idle"), ratios("loaded")
    equal = ("pfl-1-spin", "pfl-1t", "pfl-2")

    def span(values):
        return f"{min(values):.2f}-{max(values):.2f}x"

    speed = " ".join(read("docs/speed.md").split())
    said = (
        f"pfl took {span([idle[c] for c in equal])} CleanFL's time a round idle and {span([loaded[c] for c in equal])}"
    )
    assert said in speed
    assert f"took {idle['pfl-1']:.2f}x the scripts' default's time idle and {loaded['pfl-1']:.2f}x loaded" in speed
    ours = [r["test_acc"] for r in runs if r["config"].startswith("cleanfl")]
    theirs = [r["test_acc"] for r in runs if r["config"].startswith("pfl")]
    assert f"CleanFL's final accuracy, {min(ours):.4f}-{max(ours):.4f}, is a point below pfl's" in speed
    assert f"{min(theirs):.4f}-{max(theirs):.4f}" in speed
    assert 0.005 <= min(theirs) - max(ours) <= 0.015


def test_layout_bottom_line_is_its_table():
    """speed.md's image-layout bottom line: channels-last over channels-first, evaluation and training step, for each
    group of families, from layout.json; VGG11, the one slower in training, keeps its layout (fedfn.py)."""
    rows = results("layout.json")["rows"]

    def span(models):
        evaluation = [r["last"][1] / r["first"][1] for r in rows if r["model"] in models]
        step = [r["last"][0] / r["first"][0] for r in rows if r["model"] in models]
        return f"{min(evaluation):.2f}-{max(evaluation):.2f}x and {min(step):.2f}-{max(step):.2f}x", max(step)

    small, _ = span(["cnn", "pfl-cnn", "convnet4", "mobilenet"])
    resnets, _ = span(["resnet18", "resnet18-gn", "resnet18-nf"])
    vgg, vgg_step = span(["vgg11"])
    speed = " ".join(read("docs/speed.md").split())
    assert f"took {small} of the time of an evaluation and of a training step for the small CNNs and MobileNet" in speed
    assert f"{resnets} for the ResNets and {vgg} for VGG11" in speed
    assert vgg_step > 1.1


def test_intel_threads_and_memory_bottom_lines_are_their_runs():
    """speed.md's Intel table is threads.py's from its JSON, the bottom line quotes its ratios, and the memory bottom
    line's figures (one process's peak less its images, eight processes' total) are memory-cpu-build.json's."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import threads

    saved = results("threads-intel.json")
    made = threads.bounds(saved["runs"], argparse.Namespace(**saved["args"]))
    assert block("docs/speed.md", "threads-intel") == made
    ratios = [float(line.split("|")[-3]) for line in made.splitlines()[2:]]
    speed = " ".join(read("docs/speed.md").split())
    assert f"misses the idle bound: {min(ratios):.2f}-{max(ratios):.2f}x the fastest one-process setting" in speed
    runs = results("memory-cpu-build.json")["runs"]

    def peak(data, k):
        [run] = [r for r in runs if r["data"] == data and r["processes"] == k]
        return run["peak_pss_bytes"] / 1e9, run["images_bytes"] / 1e9

    (cifar, cifar_images), (tiny, tiny_images) = peak("cifar10", 1), peak("tiny-imagenet-shape", 1)
    said = f"plus {cifar - cifar_images:.2f} GB on CIFAR-10 and {tiny - tiny_images:.2f} GB on data of Tiny-ImageNet's"
    assert said in speed and max(cifar - cifar_images, tiny - tiny_images) <= 0.6
    eight, images = peak("tiny-imagenet-shape", 8)
    assert f"8 processes on Tiny-ImageNet's shape take {eight:.2f} GB in all" in speed
    assert f"eight copies of its {images:.2f} GB of images alone would take {8 * images:.1f} GB" in speed
    assert eight < 8 * images
