"""The docs say what runs: every `python <script>.py ...` command in README.md and docs/*.md (code blocks
and inline code) is accepted by that script's own parser, called in-process without running anything;
every `bash X.sh` / `pip install -r X` names an existing file; every relative link and image resolves
(with its #anchor, for markdown targets); every table row has its header's number of cells; each
method page has the fixed sections in order; every code pointer `<script>.py: <name>` names a definition
of that script, and each bullet of a method page's "Implementation details and deviations" holds one;
the README stays short; every figure the README repeats (Results from the runs in benchmarks/results and the
docs pages, mutation counts from tests/README.md, the overhead bound from docs/speed.md) agrees with its source.
Parsers only: about a second."""

import argparse
import glob
import importlib
import itertools
import json
import os
import re
import shlex
import sys

import pytest

from helpers import stand_in_folder, stand_in_groups, stand_in_tinyimagenet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
METHODS = ["fedavg", "fedbabu", "fedfn", "fedln", "fednnnn", "anfr"]
SECTIONS = [
    "Paper and idea",
    "Usage",
    "Flags beyond fedavg.py's",
    "What is logged",
    "Implementation details and deviations",
    "Results",
    "Paper's numbers beside ours",
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
    real = lambda argv: (
        argv[0] in ("bash", "pip", "torchrun")
        or (
            argv[0] in ("python", "python3")
            and len(argv) > 1
            and (argv[1] == "-m" or re.fullmatch(r"[\w./-]+\.py", argv[1]))
        )
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
    value = lambda flag: argv[argv.index(flag) + 1] if flag in argv[:-1] else None
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
    README's quick commands cover the four most used."""
    text = read("docs/datasets.md")
    found = {d for w, _, d in DATASET_COMMANDS if w.startswith("docs/datasets.md")}
    assert found == set(PAPER_SETTINGS), sorted(set(PAPER_SETTINGS) - found)
    for where, _, dataset in DATASET_COMMANDS:
        if where.startswith("docs/datasets.md"):
            line = int(where.split(":")[1])
            before = "\n".join(text.splitlines()[max(0, line - 16) : line])
            assert PAPER_SETTINGS[dataset][2] in before, f"{where}: the text above does not cite the paper's setting"
    assert {d for w, _, d in DATASET_COMMANDS if w.startswith("README.md")} >= {
        "isic",
        "pacs",
        "tinyimagenet",
        "femnist",
    }


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
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", read(doc)))
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose)


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


def test_readme_is_short():
    assert len(read("README.md").splitlines()) <= 200


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


def runs(claim, scale, *variants, metric="final test acc", kind="runs"):  # kind runs-h200: benchmarks/results-h200
    return [(kind, claim, scale, v, metric) for v in variants]


def paper(claim, *variants, metric="final test acc"):
    return [("paper", claim, None, v, metric) for v in variants]


def text(path, count):
    return [("text", path, None, None, None)] * count


# README "Results": row (its first word) -> column -> where each decimal number of that cell comes from, in order
PERS, INIT, FT1 = "personalized (5 ft epochs)", "initial (0 ft epochs)", "after 1 ft epoch"
BEST_VAL, LAST5 = "test acc at best val (the paper's)", "mean of the last 5 evaluations"
RESULTS_SOURCES = {
    "1.": {
        "paper": paper("fedfn-s2", "fedfn", "fedavg") + paper("fedfn-s10", "fedfn", "fedavg"),
        "ours, small scale": runs("fedfn-s2", "small", "fedfn", "fedavg")
        + runs("fedfn-s10", "small", "fedfn", "fedavg"),
        "verdict": runs("fedfn-s2", "proxy", "fedfn", "fedavg")
        + runs("fedfn-s10", "proxy", "fedfn", "fedavg")
        + text("docs/fedfn.md", 1)  # alpha 0.1
        + runs("fedfn-a0.1", "proxy", "fedfn", "fedavg")
        + runs("fedfn-a0.1", "proxy", "fedfn-e5", "fedavg-e5")  # E=5, seeds 0 and 1
        + runs("fedfn-a0.1", "proxy", "fedfn-e5", "fedavg-e5", metric=LAST5)
        + text("docs/fedfn.md", 1)  # alpha 0.5
        + runs("fedfn-a0.5", "proxy", "fedfn", "fedavg"),
    },
    "1b.": {"ours, small scale": runs("fedfn-s2", "small", "fedfn-sqrtd") + runs("fedfn-s10", "small", "fedfn-sqrtd")},
    "2.": {
        "claim": text("docs/fedbabu.md", 2),  # Table 6's CIFAR-100 numbers, quoted on the page
        "paper": paper("fedbabu", "fedbabu", "fedavg", metric=PERS),
        "ours, small scale": runs("fedbabu", "small", "fedbabu", "fedavg", metric=PERS)
        + runs("fedbabu", "small", "fedbabu", "fedavg", metric=FT1),
        "ours, paper scale": runs("fedbabu", "paper", "fedbabu", "fedavg", metric=PERS)
        + runs("fedbabu", "paper", "fedbabu", "fedavg", metric=INIT)
        + runs("fedbabu", "paper", "fedbabu", "fedavg", metric=FT1)
        + runs("fedbabu", "paper", "fedbabu", "fedavg", metric=PERS, kind="runs-h200"),
        "verdict": runs("fedbabu", "proxy", "fedbabu", "fedavg", metric=PERS),
    },
    "3.": {
        "paper": paper("fedln", "ln", "fn", "vanilla", "bn"),
        "ours, small scale": runs("fedln", "small", "ln", "fn", "vanilla", "bn"),
    },
    "4.": {
        "paper": paper("fednnnn", "fednnnn", "fedavg"),
        "ours, small scale": runs("fednnnn", "small", "fednnnn", "fedavg"),
        "verdict": runs("fednnnn", "small", "fednnnn", "fedavg", metric=LAST5),
    },
    "5.": {
        "paper": paper("anfr", "anfr", "bn", "gn", "se", "nf"),
        "ours, small scale": runs("anfr-cropflip", "small", "anfr", "bn", "gn", "se", "nf", metric=BEST_VAL)
        + runs("anfr-cropflip", "small", *(f"{a}-central" for a in ("anfr", "bn", "gn", "se", "nf")), metric=BEST_VAL)
        + runs("anfr", "small", "anfr", "bn", "gn", "se", "nf"),
        "verdict": text("docs/anfr.md", 6)  # the central gap to BN (and at 5x the steps), federation's cost
        + runs("anfr-cropflip", "proxy", "anfr", "bn", "gn", "se", "nf", metric=BEST_VAL)
        + text("docs/anfr.md", 3)  # ANFR's gap to BN, mean |g|
        + text("docs/anfr.md", 1)  # centrally: ANFR's gap to BN (3-seed means)
        + runs("anfr-cropflip", "proxy", "anfr-central-total", "bn-central-total", metric=BEST_VAL)  # 5x, seed 0
        + text("docs/anfr.md", 2)  # federation's cost to ANFR and BN (3-seed means)
        + runs("anfr-rrc", "proxy", "anfr", "bn", metric=BEST_VAL)  # the paper's recipe (3 seeds)
        + text("docs/anfr.md", 2)  # ANFR's gap to BN under it and with pad-crop and flip (means)
        + runs("anfr", "proxy", "anfr", "bn", "gn", "se", "nf"),
    },
}


def readme_table(heading):
    """The README table under `## heading`: {first word of a row: {column: cell}}, split at unescaped pipes."""
    section = read("README.md").split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("| ---")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
    return {row[0].split()[0]: dict(zip(cells[0], row)) for row in cells[1:]}


def test_readme_results_are_the_runs_and_the_docs_tables():
    """Every decimal number of the README's Results table, cell by cell: a result of ours is the mean over the
    seeds of the runs in benchmarks/results (benchmarks/collect.py's reading, the docs tables' source) to the
    README's digits, and its docs page (the row's details link) shows the same mean to two decimals; a paper's
    number is the one collect.py tables beside it; a quoted one stands in the linked page."""
    import collect

    found = {kind: collect.gather(os.path.join(ROOT, "benchmarks", root))
             for kind, root in (("runs", "results"), ("runs-h200", "results-h200"))}  # fmt: skip
    table = readme_table("Results")
    assert set(table) == set(RESULTS_SOURCES), "a row was added or renamed: say where its numbers come from"
    checked = 0
    for row, cells in table.items():
        page = read(re.search(r"\(([\w/.-]+\.md)#results\)", cells["details"]).group(1))
        for column, cell in cells.items():
            numbers = NUMBER.findall(cell) if column != "details" else []
            sources = RESULTS_SOURCES.get(row, {}).get(column, [])
            assert len(numbers) == len(sources), f"README Results {row} {column}: {numbers} but sources {sources}"
            for shown, (kind, source, scale, variant, metric) in zip(numbers, sources):
                where = f"README Results {row} {column}: {shown}"
                if kind == "text":  # source: a page
                    assert shown in read(source), f"{where} is not in {source}"
                    continue
                # source: a claim of collect.py, with its variants' metrics and the paper's numbers beside them
                _, how, papers = next(m for m in collect.CLAIMS[source]["metrics"] if m[0] == metric)
                if kind == "paper":
                    assert shown in NUMBER.findall(papers[variant]), (
                        f"{where}, the paper's {variant}: {papers[variant]}"
                    )
                    continue
                ok = [r for r in found[kind][(source, scale)][variant]["runs"] if not r["summary"].get("diverged")]
                mean = 100 * collect.mean_std([collect.value(r, how) for r in ok])[0]
                digits = len(shown.split(".")[1])
                assert abs(float(shown) - mean) <= 0.5 * 10**-digits + 1e-9, f"{where}, the runs: {mean:.3f}"
                two = {f"{mean + d:.2f}" for d in (-1e-6, 0, 1e-6)}  # either way at a tie (x.xx5)
                assert any(t in page for t in two), f"{where}: its page does not show {mean:.2f}"
                checked += 1
    assert checked == 69  # every result of ours in the table


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
    """docs/speed.md's threads tables (the six cases; the loaded CNN's again over 3 cycles) and Flower table are
    what benchmarks/threads.py and vs_flower.py print from the JSON they wrote (benchmarks/results-cpu/), cell for
    cell; the README's torchrun figure is the threads table's."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import threads
    import vs_flower

    speed = read("docs/speed.md")
    for name, module in (("threads", threads), ("threads-cnn-loaded", threads), ("vs_flower", vs_flower)):
        with open(os.path.join(ROOT, "benchmarks", "results-cpu", f"{name}.json")) as f:
            saved = json.load(f)
        shown = speed.split(f"<!-- {name}:start -->\n", 1)[1].split(f"\n<!-- {name}:end -->", 1)[0]
        args = argparse.Namespace(**saved["args"])
        made = (
            threads.table(saved["runs"], args)
            if module is threads
            else vs_flower.table(saved["runs"], args.configs, args.rounds)
        )
        assert shown.strip() == made.strip(), f"docs/speed.md's {name} table is not its JSON's"
        if name == "threads":
            saved_threads = {"runs": saved["runs"], "args": args}
        elif name == "vs_flower":  # the README's ratio at each side's default
            ratio = next(row for row in made.splitlines() if row.startswith("| flower-default")).split("|")[-2].strip()
            assert f"`fedavg.py` is {ratio} faster than Flower" in " ".join(read("README.md").split())
            floor = saved["floor_s"]  # compute_floor's seconds at 2 threads and 1, as the page quotes them
            assert f"take {floor['2']:.2f} s at 2 threads and {floor['1']:.2f} s at one" in " ".join(speed.split())
    rows = [row for row in threads.table(*[saved_threads[k] for k in ("runs", "args")]).splitlines()[2:]]
    best = max(float(row.split("|")[-2]) for row in rows)  # default / torchrun: torchrun's best speed-up
    assert f"(up to {best:.2f}x)" in " ".join(read("README.md").split())
