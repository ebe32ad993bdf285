"""benchmarks/prepare_data.py: FLamby's Fed-ISIC2019 CSV, PACS's folders and LEAF's FEMNIST and CelebA JSON laid
out as the image folders the scripts read (--natural, --clients-per-domain), and what it refuses before writing
anything. Every source is built here with tiny PIL images; the prepared folders are read back by the scripts."""

import json
import os
import stat
import sys

import numpy as np
import pytest

import common
from test_datasets import counts, load, write_images

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


# ---------------------------------------------------------------------------------------------------- isic, pacs
FLAMBY_HEADER = "image,MEL,NV,BCC,AK,BKL,DF,VASC,SCC,UNK,target,center,fold,fold2"  # train_test_split's columns


def run_prepare(argv, capsys):
    """benchmarks/prepare_data.py in-process: (exit code, stderr's lines)."""
    import prepare_data

    capsys.readouterr()
    try:
        prepare_data.main(list(map(str, argv)))
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


def prepare(argv, capsys):
    """(exit code, stderr's last line)."""
    code, err = run_prepare(argv, capsys)
    return code, err[-1] if err else ""


def refused(argv, capsys):
    """stderr's one line where prepare_data.py refuses argv (exit status 2)."""
    code, err = run_prepare(argv, capsys)
    assert code == 2 and len(err) == 1, (code, err)
    return err[0]


def partials(root):
    return [f for f in os.listdir(root) if ".partial-" in f]


def flamby_csv(path, rows):
    """FLamby's train_test_split with its real columns: one-hot diagnoses, target, center, fold, fold2."""
    lines = [FLAMBY_HEADER]
    for image, target, center, fold in rows:
        onehot = ",".join("1.0" if k == target else "0.0" for k in range(9))
        lines.append(f"{image},{onehot},{target},{center},{fold},{fold}_{center}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def isic_source(tmp_path):
    from PIL import Image

    os.makedirs(tmp_path / "isic_raw")
    rows = [("ISIC_0000000", 0, 0, "train", (30, 20)), ("ISIC_0000001", 1, 0, "test", (20, 26)),
            ("ISIC_0012669_downsampled", 1, 1, "train", (24, 24)),
            ("ISIC_0000003", 0, 1, "test", (40, 22))]  # fmt: skip
    for name, _, _, _, wh in rows:
        Image.new("RGB", wh, (9, 9, 9)).save(tmp_path / "isic_raw" / f"{name}.jpg")
    return flamby_csv(tmp_path / "train_test_split", [r[:4] for r in rows]), str(tmp_path / "isic_raw")


def files_under(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_prepare_data_lays_out_fed_isic2019_from_flamby_s_real_csv(tmp_path, monkeypatch, capsys):
    csv_path, images = isic_source(tmp_path)
    out = tmp_path / "isic"
    code, last = prepare(["isic", "--csv", csv_path, "--images", images, "--out", out, "--size", "16"], capsys)
    assert code == 0 and "4 images written" in last, last
    assert (out / "train" / "center1" / "class1" / "ISIC_0012669_downsampled.png").exists()
    with Image_open(out / "test" / "center1" / "class0" / "ISIC_0000003.png") as im:
        assert im.size == (16, 16) and im.mode == "RGB"
    # FLamby's 8 classes in classes.txt: the head has 8 outputs although this subset holds 2 classes
    assert (out / "classes.txt").read_text().split() == [f"class{y}" for y in range(8)]
    args, data, part = load(
        "anfr", ["--dataset", "folder", "--data-dir", out, "--natural", "--depth", "18"], monkeypatch
    )
    assert part.names == ["center0", "center1"] and data.num_classes == 8
    assert counts(data.y_test, part.test, 8) == [[0, 1, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    assert not [f for f in os.listdir(tmp_path) if ".partial-" in f]  # the temporary folder became --out


def Image_open(path):
    from PIL import Image

    return Image.open(path)


def test_prepare_data_refuses_bad_input_before_writing_anything(tmp_path, capsys):
    csv_path, images = isic_source(tmp_path)
    out = tmp_path / "isic"
    base = ["isic", "--images", images, "--out", out]
    # FLamby's data-folder metadata instead of train_test_split: the line says where the right file is
    meta = tmp_path / "ISIC_2019_Training_Metadata_FL.csv"
    meta.write_text("image,age_approx,anatom_site_general,lesion_id,sex,dataset\nISIC_0000000,55.0,anterior torso,"
                    "BCN_0000001,male,BCN_nevi\n")  # fmt: skip
    code, last = prepare([*base, "--csv", meta], capsys)
    assert code == 2 and "--csv" in last and "fold" in last and "ISIC_2019_Training_Metadata_FL.csv" in last
    assert "flamby/datasets/fed_isic2019/dataset_creation_scripts/train_test_split" in last
    # two listed images missing: the count and the first names
    os.remove(os.path.join(images, "ISIC_0000001.jpg"))
    os.remove(os.path.join(images, "ISIC_0000003.jpg"))
    code, last = prepare([*base, "--csv", csv_path], capsys)
    assert code == 2 and "--images" in last and "2 of the 4" in last and "ISIC_0000001.jpg" in last, last
    bad = flamby_csv(tmp_path / "bad", [("ISIC_0000000", 0, 0, "val")])  # fold must be train or test
    code, last = prepare([*base, "--csv", bad], capsys)
    assert code == 2 and "--csv" in last and "line 2" in last
    for args, flag in [
        (["--csv", tmp_path / "nope"], "--csv"),
        (["--csv", csv_path, "--images", tmp_path], "--images"),
    ]:
        code, last = prepare(["isic", "--images", images, "--out", out, *args], capsys)
        assert code == 2 and flag in last, last
    assert not out.exists() and not [f for f in os.listdir(tmp_path) if ".partial-" in f]


@pytest.mark.parametrize(
    "row, said",
    [(("ISIC_0000001", 9, 0, "test"), "target 9 is not in 0..7"),
     (("ISIC_0000001", 8, 0, "test"), "target 8 is not in 0..7"),  # FLamby's UNK column: no image has it
     (("ISIC_0000001", 1, 6, "test"), "center 6 is not in 0..5"), (("ISIC_0000001", 1, 7, "test"), "center 7"),
     (("ISIC_0000000", 1, 1, "test"), "ISIC_0000000 is on line 2 (train) and line 3 (test)")],
)  # fmt: skip
def test_prepare_data_refuses_isic_rows_out_of_range_or_listed_twice(row, said, tmp_path, capsys):
    """A target of 9 gave classes.txt class0-class9 (a model of 10 outputs), a center of 7 a seventh client, an
    image on a train and a test row was written to both (a test image in training): each refused in one line
    naming the CSV, the line and the value, nothing written."""
    _, images = isic_source(tmp_path)
    bad = flamby_csv(tmp_path / "split", [("ISIC_0000000", 0, 0, "train"), row, ("ISIC_0000003", 0, 1, "test")])
    out = tmp_path / "isic"
    last = refused(["isic", "--csv", bad, "--images", images, "--out", out], capsys)
    assert "--csv" in last and bad in last and "line 3" in last and said in last, last
    assert not out.exists() and not partials(tmp_path)


def test_prepare_data_isic_numbers_with_leading_zeros_are_flamby_s_classes(tmp_path, capsys):
    csv_path, images = isic_source(tmp_path)
    with open(csv_path, encoding="utf-8") as f:
        text = f.read()
    assert text.count(",1,0,test,") == 1  # ISIC_0000001: target 1, center 0
    with open(csv_path, "w", encoding="utf-8") as f:
        f.write(text.replace(",1,0,test,", ",01,00,test,"))
    out = tmp_path / "isic"
    assert prepare(["isic", "--csv", csv_path, "--images", images, "--out", out], capsys)[0] == 0
    assert sorted(os.listdir(out / "test")) == ["center0", "center1"]  # not center00, which --natural would add
    assert os.listdir(out / "test" / "center0") == ["class1"]  # not class01, which classes.txt does not list


def test_prepare_data_refuses_a_csv_that_is_not_utf8(tmp_path, capsys):
    """--csv given a UTF-16 file (a spreadsheet's "Unicode text") or an image raised UnicodeDecodeError."""
    csv_path, images = isic_source(tmp_path)
    utf16 = tmp_path / "split_utf16.csv"
    with open(csv_path, encoding="utf-8") as f:
        utf16.write_text(f.read(), encoding="utf-16")
    out = tmp_path / "isic"
    for given in (utf16, os.path.join(images, "ISIC_0000000.jpg")):
        last = refused(["isic", "--csv", given, "--images", images, "--out", out], capsys)
        assert "--csv" in last and f"{given} is not UTF-8 text" in last, last
    assert not out.exists() and not partials(tmp_path)


@pytest.mark.parametrize(
    "flags, named",
    [(["--test-frac", "0"], "--test-frac"), (["--test-frac", "1"], "--test-frac"),
     (["--test-frac", "1.5"], "--test-frac"), (["--test-frac", "nan"], "--test-frac"), (["--size", "0"], "--size"),
     (["--size", "-3"], "--size"), (["--size", "2.5"], "--size"), (["--seed", "-1"], "--seed")],
)  # fmt: skip
def test_prepare_data_bad_flag_values_exit_2_naming_the_flag(flags, named, tmp_path, capsys):
    write_images(tmp_path / "PACS", {"photo/dog": 2})
    code, last = prepare(["pacs", "--src", tmp_path / "PACS", "--out", tmp_path / "pacs", *flags], capsys)
    assert code == 2 and f"argument {named}" in last, last
    assert not (tmp_path / "pacs").exists()


@pytest.mark.parametrize(
    "dataset, defaults",
    [("isic", {"--size SIZE": 64}), ("pacs", {"--test-frac TEST_FRAC": 0.2, "--seed SEED": 0, "--size SIZE": "keep"}),
     ("femnist", {}), ("celeba", {"--size SIZE": 64})],
)  # fmt: skip
def test_prepare_data_help_shows_the_defaults(dataset, defaults, capsys):
    import prepare_data

    with pytest.raises(SystemExit) as e:
        prepare_data.main([dataset, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert e.value.code == 0 and f" {dataset} [-h]" in text
    for flag, default in defaults.items():  # the help after the flag (the usage line has "[--seed SEED]")
        helped = text.split(f" {flag} ", 1)[1].split(" --", 1)[0]
        assert f"(default: {default})" in helped, (flag, helped)
    assert "(default: None)" not in text and "(default: False)" not in text  # --out, --overwrite: none to show


def pacs_source(root, per_class=5):
    """PACS as distributed: sketch PNGs in L, RGBA and RGB modes, the other domains' JPEGs."""
    from PIL import Image

    for d in ("photo", "sketch"):
        for c in ("dog", "horse"):
            os.makedirs(root / d / c)
            for i in range(per_class):
                if d == "sketch":
                    mode = ("L", "RGBA", "RGB")[i % 3]
                    Image.new(mode, (12, 12), 200 if mode == "L" else (200,) * len(mode)).save(
                        root / d / c / f"{i}.png"
                    )
                else:
                    Image.new("RGB", (12, 12), (7 * i + 1, 0, 0)).save(root / d / c / f"pic_{i:03d}.jpg")
    return str(root)


def split_of(out):
    """{(domain, class): (train names, test names)} of a prepared PACS folder."""
    got = {}
    for d in sorted(os.listdir(out / "train")):
        for c in sorted(os.listdir(out / "train" / d)):
            got[d, c] = tuple(set(os.listdir(out / s / d / c)) for s in ("train", "test"))
    return got


def test_prepare_data_never_mixes_two_conversions(tmp_path, monkeypatch, capsys):
    """A second run into the same --out with another --seed is refused; with --overwrite the folder is the second
    run's alone: train and test disjoint, together the source's images (the 34-of-140 leak cannot happen)."""
    src, out = pacs_source(tmp_path / "PACS", per_class=10), tmp_path / "pacs"
    assert prepare(["pacs", "--src", src, "--out", out], capsys)[0] == 0
    first = files_under(out)
    code, last = prepare(["pacs", "--src", src, "--out", out, "--seed", "1"], capsys)
    assert code == 2 and "--out" in last and "--overwrite" in last and files_under(out) == first
    code, last = prepare(["pacs", "--src", src, "--out", out, "--seed", "1", "--test-frac", "0.5", "--overwrite"],
                         capsys)  # fmt: skip
    assert code == 0, last
    for (d, c), (train, test) in split_of(out).items():
        stems = {os.path.splitext(f)[0] for f in os.listdir(os.path.join(src, d, c))}
        assert not train & test and {os.path.splitext(f)[0] for f in train | test} == stems
        assert len(test) == 5  # round(0.5 * 10): the second run's fraction, not the first's 2
    assert files_under(out) != first
    # an empty --out is fine; an --out holding the source is refused, even with --overwrite
    os.makedirs(tmp_path / "empty")
    assert prepare(["pacs", "--src", src, "--out", tmp_path / "empty"], capsys)[0] == 0
    code, last = prepare(["pacs", "--src", src, "--out", tmp_path, "--overwrite"], capsys)
    assert code == 2 and "--out" in last and "overlap" in last and os.path.isdir(src)


def test_prepare_data_leaves_no_half_output(tmp_path, monkeypatch, capsys):
    """A failure or Ctrl-C half-way leaves --out as it was (absent, or the previous conversion whole) and no
    temporary folder."""
    import prepare_data

    src, out = pacs_source(tmp_path / "PACS"), tmp_path / "pacs"
    real, calls = prepare_data.open_rgb, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(prepare_data, "open_rgb", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_data.main(["pacs", "--src", src, "--out", str(out)])
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["PACS"]
    monkeypatch.setattr(prepare_data, "open_rgb", real)
    assert prepare(["pacs", "--src", src, "--out", out], capsys)[0] == 0
    before = files_under(out)
    calls.clear()
    monkeypatch.setattr(prepare_data, "open_rgb", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_data.main(["pacs", "--src", src, "--out", str(out), "--overwrite", "--seed", "3"])
    assert files_under(out) == before and sorted(os.listdir(tmp_path)) == ["PACS", "pacs"]


def contents(root):
    """{path under root: bytes, or None for a folder}: everything in root."""
    found = {}
    for d, dirs, files in os.walk(root):
        found.update({os.path.relpath(os.path.join(d, x), root): None for x in dirs})
        for x in files:
            with open(os.path.join(d, x), "rb") as f:
                found[os.path.relpath(os.path.join(d, x), root)] = f.read()
    return found


def test_prepare_data_overwrites_only_its_own_output(tmp_path, monkeypatch, capsys):
    """--overwrite emptied any folder (a folder of notes was deleted; --out ~ would delete a home): it replaces
    only a folder holding .cleanfl-prepared, which every conversion writes with its arguments. Any other non-empty
    folder is refused in one line, with or without --overwrite, and left as it was."""
    import prepare_data

    src = pacs_source(tmp_path / "PACS")
    (tmp_path / "notes" / "drafts").mkdir(parents=True)
    (tmp_path / "notes" / "todo.txt").write_text("write the paper\n")
    (tmp_path / "notes" / "drafts" / "intro.md").write_text("# Introduction\n")
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    (tmp_path / "home" / ".bashrc").write_text("export EDITOR=vi\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # --out ~
    before = contents(tmp_path)
    for out, held in ((tmp_path / "notes", "drafts, todo.txt"), ("~", ".bashrc, .ssh")):
        for overwrite in (["--overwrite"], []):
            last = refused(["pacs", "--src", src, "--out", out, *overwrite], capsys)
            assert "--out" in last and f"holds {held} and is not a prepare_data.py output" in last, last
            assert prepare_data.MARKER in last
    assert contents(tmp_path) == before  # nothing written or deleted
    out = tmp_path / "pacs"
    assert prepare(["pacs", "--src", src, "--out", out, "--test-frac", "0.4"], capsys)[0] == 0
    stamp = json.loads((out / prepare_data.MARKER).read_text())
    assert stamp["dataset"] == "pacs" and stamp["args"]["src"] == src and stamp["args"]["test_frac"] == 0.4
    assert prepare(["pacs", "--src", src, "--out", out, "--overwrite", "--seed", "5"], capsys)[0] == 0
    assert json.loads((out / prepare_data.MARKER).read_text())["args"]["seed"] == 5
    os.remove(out / prepare_data.MARKER)  # an earlier conversion's folder without its marker: not replaced either
    kept = contents(out)
    assert "not a prepare_data.py output" in refused(["pacs", "--src", src, "--out", out, "--overwrite"], capsys)
    assert contents(out) == kept


def test_prepare_data_folders_get_the_usual_mode(tmp_path, capsys):
    """The prepared folder was mkdtemp's 0o700 (and an existing 0o755 one became 0o700): a new --out gets 0o777
    less the umask, as its sub-folders do, and an existing empty one keeps its own mode."""
    src = pacs_source(tmp_path / "PACS")
    (tmp_path / "c").mkdir()
    os.chmod(tmp_path / "c", 0o775)  # a group's folder
    umask = os.umask(0o022)
    try:
        assert prepare(["pacs", "--src", src, "--out", tmp_path / "a"], capsys)[0] == 0
        assert prepare(["pacs", "--src", src, "--out", tmp_path / "c"], capsys)[0] == 0
        os.umask(0o027)
        assert prepare(["pacs", "--src", src, "--out", tmp_path / "b"], capsys)[0] == 0
    finally:
        os.umask(umask)

    def mode(path):
        return stat.S_IMODE(os.stat(path).st_mode)

    assert [mode(tmp_path / d) for d in "abc"] == [0o755, 0o750, 0o775]
    assert mode(tmp_path / "a" / "train" / "photo") == 0o755 and mode(tmp_path / "b" / "test" / "sketch") == 0o750


def test_prepare_data_skips_stray_files_and_unreadable_images(tmp_path, monkeypatch, capsys):
    src, out = pacs_source(tmp_path / "PACS"), tmp_path / "pacs"
    (tmp_path / "PACS" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (tmp_path / "PACS" / "sketch" / "dog" / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    (tmp_path / "PACS" / "photo" / "readme.txt").write_text("PACS")
    (tmp_path / "PACS" / "photo" / "horse" / "pic_999.jpg").write_bytes(b"not a JPEG")  # unreadable
    code, last = prepare(["pacs", "--src", src, "--out", out, "--size", "8"], capsys)
    assert code == 0, last
    assert "20 images written" in last and "skipped 3 stray non-image files" in last and ".DS_Store" in last
    assert "skipped 1 unreadable image" in last and "pic_999" in last and len(last.splitlines()) == 1
    assert sum(len(tr) + len(te) for tr, te in split_of(out).values()) == 20
    assert not any("pic_999" in f for f in files_under(out))


def test_prepare_data_pacs_sketch_modes_are_rgb_and_fedln_reads_them(tmp_path, monkeypatch, capsys):
    src, out = pacs_source(tmp_path / "PACS"), tmp_path / "pacs"
    code, last = prepare(["pacs", "--src", src, "--out", out], capsys)
    assert code == 0, last
    for d in ("photo", "sketch"):
        for c in ("dog", "horse"):  # round(0.2 * 5) = 1 test image of each domain's class
            assert len(os.listdir(out / "train" / d / c)) == 4 and len(os.listdir(out / "test" / d / c)) == 1
    for name in files_under(out / "train" / "sketch"):
        with Image_open(out / "train" / "sketch" / name) as im:
            assert im.mode == "RGB" and im.getpixel((3, 3)) == (200, 200, 200)  # L, RGBA, RGB: the same grey
    flags = ["--dataset", "folder", "--data-dir", out, "--clients-per-domain", "1", "--iid", "--model", "resnet18"]
    args, data, part = load("fedln", flags, monkeypatch)
    assert data.x_train.shape[1:] == (3, 12, 12) and part.names == ["photo", "sketch"] and data.num_classes == 2


def test_prepare_data_shows_a_progress_bar(tmp_path, capsys):
    import prepare_data

    prepare_data.main(["pacs", "--src", pacs_source(tmp_path / "PACS"), "--out", str(tmp_path / "pacs")])
    err = capsys.readouterr().err
    assert "writing:" in err and "/20 [" in err  # tqdm's bar over the 20 images (drawn again each second)
    assert err.splitlines()[-1].endswith("(train 16, test 4)")  # then the one summary line


# ---------------------------------------------------------------------------------------------------- LEAF
def leaf_json(path, users):
    """LEAF's JSON: {"users", "num_samples", "user_data": {user: {"x": [...], "y": [...]}}}."""
    data = {"users": list(users), "num_samples": [len(d["y"]) for d in users.values()], "user_data": users}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def femnist_x(ink=(), value=0.0):
    """784 values, 1.0 (LEAF's white background) except the (row, col) pixels of ink."""
    x = [1.0] * 784
    for r, c in ink:
        x[28 * r + c] = value
    return x


# writer -> (train labels, test labels); A is 10, a is 36 (LEAF's relabel_class)
WRITERS = {"f0000_14": ([10, 36, 36, 0], [10, 36]), "f0001_41": ([61, 5, 5], [5]), "f0002_03": ([10, 10], [61, 10])}


def femnist_source(root):
    for split, k in (("train", 0), ("test", 1)):
        users = {w: {"x": [femnist_x([(3, 5)]) for _ in ys[k]], "y": ys[k]} for w, ys in WRITERS.items()}
        first = {w: users[w] for w in ("f0000_14", "f0001_41")}  # LEAF writes at most 100 writers per file
        leaf_json(root / split / f"all_data_0_niid_0_keep_0_{split}_9.json", first)
        leaf_json(root / split / f"all_data_1_niid_0_keep_0_{split}_9.json", {"f0002_03": users["f0002_03"]})
    return root


def test_prepare_data_femnist_from_leaf_json(tmp_path, monkeypatch, capsys):
    leaf, out = femnist_source(tmp_path / "leaf"), tmp_path / "femnist"
    code, last = prepare(["femnist", "--train", leaf / "train", "--test", leaf / "test", "--out", out], capsys)
    assert code == 0 and "14 images written" in last and "train 9, test 5" in last, last
    # A and a: two folders that a case-insensitive file system keeps apart
    for d, dirs, _ in os.walk(out):
        assert len({x.lower() for x in dirs}) == len(dirs), d
    assert sorted(os.listdir(out / "train" / "f0000_14")) == ["00_0", "10_A", "36_a"]
    names = (out / "classes.txt").read_text().split()
    assert len(names) == 62 and names == sorted(names)  # sorted folder names are the label order too
    assert (names[0], names[9], names[10], names[35], names[36], names[61]) == ("00_0", "09_9", "10_A", "35_Z", "36_a",
                                                                              "61_z")  # fmt: skip
    with Image_open(out / "train" / "f0000_14" / "10_A" / "f0000_14_00000.png") as im:  # LEAF's polarity, row by row
        px = np.array(im)
        assert im.mode == "L" and im.size == (28, 28) and px[3, 5] == 0 and px[5, 3] == 255 and (px == 255).sum() == 783
    # the scripts: one client per writer, its own test set, LEAF's labels, 62 classes, FedBABU's 3convNet
    args, data, part = load("fedbabu", ["--dataset", "folder", "--data-dir", out, "--natural", "--model", "convnet3"],
                            monkeypatch)  # fmt: skip
    assert part.names == sorted(WRITERS) and args.client_test and data.num_classes == 62
    assert data.x_train.shape[1:] == (1, 28, 28)
    for k, w in enumerate(sorted(WRITERS)):
        assert sorted(data.y_train[part.train[k]].tolist()) == sorted(WRITERS[w][0])
        assert sorted(data.y_test[part.test[k]].tolist()) == sorted(WRITERS[w][1])
    head = common.build_model("convnet3", data).head
    assert (head.in_features, head.out_features) == (576, 62)  # FedBABU App. A.1: Linear(576, 62)


def test_prepare_data_femnist_values_become_pixels_by_hand(tmp_path, capsys):
    x = femnist_x()
    x[0], x[1], x[28], x[783] = 0.0, 0.2, 0.5, 0.996  # round(255 x): 0, 51, 128 (127.5 to even), 254
    leaf_json(tmp_path / "train" / "a.json", {"w": {"x": [x], "y": [3]}})
    leaf_json(tmp_path / "test" / "a.json", {"w": {"x": [x], "y": [3]}})
    out = tmp_path / "out"
    assert (
        prepare(["femnist", "--train", tmp_path / "train", "--test", tmp_path / "test", "--out", out], capsys)[0] == 0
    )
    with Image_open(out / "train" / "w" / "03_3" / "w_00000.png") as im:
        px = np.array(im)
    assert (px[0, 0], px[0, 1], px[1, 0], px[27, 27], px[13, 13]) == (0, 51, 128, 254, 255)


def test_prepare_data_leaf_refusals(tmp_path, capsys):
    good = {"w": {"x": [femnist_x()], "y": [1]}}
    leaf_json(tmp_path / "test" / "a.json", good)
    cases = [
        ({"w": {"x": [femnist_x()], "y": [62]}}, "--train", "outside 0..61"),  # not FEMNIST's label
        ({"w": {"x": [femnist_x()], "y": [float("nan")]}}, "--train", "outside 0..61"),
        ({"w": {"x": [femnist_x(), femnist_x()], "y": [1]}}, "--train", "2 x but 1 y"),
        ({"w": {"x": ["000001.jpg"], "y": [1]}}, "--train", "784"),  # CelebA's JSON given to femnist
        ({"Ab": good["w"], "ab": good["w"]}, "--train", "case"),  # one folder on a case-insensitive file system
        ({"../w": good["w"]}, "--train", "folder name"),
    ]
    for users, flag, said in cases:
        leaf_json(tmp_path / "train" / "a.json", users)
        code, last = prepare(["femnist", "--train", tmp_path / "train", "--test", tmp_path / "test", "--out",
                              tmp_path / "out"], capsys)  # fmt: skip
        assert code == 2 and flag in last and said in last, (users.keys(), last)
    (tmp_path / "train" / "a.json").write_text("{not json")
    code, last = prepare(["femnist", "--train", tmp_path / "train", "--test", tmp_path / "test", "--out",
                          tmp_path / "out"], capsys)  # fmt: skip
    assert code == 2 and "--train" in last and "JSON" in last
    code, last = prepare(["femnist", "--train", tmp_path / "nothing", "--test", tmp_path / "test", "--out",
                          tmp_path / "out"], capsys)  # fmt: skip
    assert code == 2 and "--train" in last
    assert not (tmp_path / "out").exists()


def test_prepare_data_reads_leaf_json_as_utf8_whatever_the_locale(tmp_path, monkeypatch, capsys):
    """LEAF's JSON is UTF-8: read as such where the locale's encoding is another (Windows' cp1252 made the writer
    Zoë a folder ZoÃ«), and a file in UTF-16 is refused in one line naming it."""
    import builtins

    import prepare_data

    def cp1252_open(file, mode="r", *args, **kwargs):  # open() where the locale's encoding is cp1252
        if "b" not in mode:
            kwargs.setdefault("encoding", "cp1252")
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(prepare_data, "open", cp1252_open, raising=False)
    users = {"Zoë": {"x": [femnist_x()], "y": [3]}}
    data = json.dumps({"users": list(users), "num_samples": [1], "user_data": users}, ensure_ascii=False)
    for split in ("train", "test"):
        (tmp_path / f"{split}.json").write_bytes(data.encode("utf-8"))
    flags = ["femnist", "--train", tmp_path / "train.json", "--test", tmp_path / "test.json"]
    assert prepare([*flags, "--out", tmp_path / "out"], capsys)[0] == 0
    assert os.listdir(tmp_path / "out" / "train") == ["Zoë"]
    (tmp_path / "train.json").write_text(data, encoding="utf-16")
    last = refused([*flags, "--out", tmp_path / "again"], capsys)
    assert "--train" in last and f"{tmp_path / 'train.json'} is not UTF-8 text" in last, last
    assert not (tmp_path / "again").exists()


def celeba_source(root):
    """LEAF's CelebA: x an image name of img_align_celeba/ (178x218 JPEGs), y 0.0 or 1.0 as LEAF writes them."""
    from PIL import Image

    os.makedirs(root / "img_align_celeba")
    users = {"2880": [(1, 1.0), (2, 0.0), (3, 1.0)], "7": [(4, 0.0), (5, 0.0)]}
    test = {"2880": [(6, 1.0)], "7": [(7, 1.0)]}
    for split, data in (("train", users), ("test", test)):
        for samples in data.values():
            for i, _ in samples:
                Image.new("RGB", (178, 218), (i, 100, 0)).save(root / "img_align_celeba" / f"{i:06d}.jpg", quality=95)
        users = {u: {"x": [f"{i:06d}.jpg" for i, _ in s], "y": [y for _, y in s]} for u, s in data.items()}
        leaf_json(root / split / f"all_data_niid_0_keep_5_{split}_9.json", users)
    return root


def test_prepare_data_celeba_from_leaf_json(tmp_path, monkeypatch, capsys):
    leaf, out = celeba_source(tmp_path / "leaf"), tmp_path / "celeba"
    flags = ["celeba", "--train", leaf / "train", "--test", leaf / "test", "--images", leaf / "img_align_celeba"]
    code, last = prepare([*flags, "--out", out, "--size", "16"], capsys)
    assert code == 0 and "7 images written" in last, last
    assert (out / "classes.txt").read_text().split() == ["0_not_smiling", "1_smiling"]
    assert sorted(os.listdir(out / "train" / "2880" / "1_smiling")) == ["000001.png", "000003.png"]  # CelebA's names
    with Image_open(out / "test" / "7" / "1_smiling" / "000007.png") as im:
        assert im.size == (16, 16) and abs(im.getpixel((8, 8))[1] - 100) <= 2
    args, data, part = load("anfr", ["--dataset", "folder", "--data-dir", out, "--natural", "--depth", "18"],
                            monkeypatch)  # fmt: skip
    assert part.names == ["2880", "7"] and data.num_classes == 2 and len(part.train) == 2
    assert counts(data.y_train, part.train, 2) == [[1, 2], [2, 0]] and counts(data.y_test, part.test, 2) == [
        [0, 1],
        [0, 1],
    ]
    os.remove(leaf / "img_align_celeba" / "000004.jpg")
    code, last = prepare([*flags, "--out", tmp_path / "again"], capsys)
    assert code == 2 and "--images" in last and "000004.jpg" in last and "1 of the 7" in last
    assert not (tmp_path / "again").exists()


def test_prepare_data_leaf_split_by_user_gives_one_shared_test_folder(tmp_path, monkeypatch, capsys):
    """LEAF's -t user puts whole users in test: the test images become one shared test/<class>/ (every class
    folder present, as the scripts need), which --natural --client-test deals by training labels."""
    leaf_json(tmp_path / "train" / "a.json", {"u1": {"x": [femnist_x()] * 3, "y": [0, 1, 1]},
                                              "u2": {"x": [femnist_x()] * 2, "y": [0, 0]}})  # fmt: skip
    leaf_json(tmp_path / "test" / "a.json", {"u3": {"x": [femnist_x()] * 2, "y": [1, 0]}})
    out = tmp_path / "out"
    code, last = prepare(["femnist", "--train", tmp_path / "train", "--test", tmp_path / "test", "--out", out], capsys)
    assert code == 0 and "shared test/<class>/" in last, last
    assert len(os.listdir(out / "test")) == 62 and len(files_under(out / "test")) == 2
    args, data, part = load("fedavg", ["--dataset", "folder", "--data-dir", out, "--natural", "--model", "mlp"],
                            monkeypatch)  # fmt: skip
    assert len(part.train) == 2 and data.group_test is None and sorted(data.y_test.tolist()) == [0, 1]


# ---------------------------------------------------------------------------------------------------- resize
RESIZE_LAYOUTS = {  # folder -> images; flat, clients with their own test/, clients with one shared test/
    "flat": ({"train/ant": 3, "train/bee": 4, "test/ant": 1, "test/bee": 2}, ["--iid", "--num-clients", "1"]),
    "groups": ({"train/c0/ant": 4, "train/c0/bee": 1, "train/c1/bee": 2, "test/c0/ant": 1, "test/c1/bee": 3},
               ["--natural"]),
    "shared": ({"train/c0/ant": 2, "train/c1/bee": 4, "test/ant": 1, "test/bee": 2}, ["--natural"]),
}  # fmt: skip


def resize_source(root, folders):
    """Image i of a folder, of pixel value 7 i + 1: an 8x8 RGB PNG, a 12x10 RGB PNG, a 10x12 grayscale PNG, a 12x10
    RGB JPEG, in turn; classes.txt not in sorted order (bee is label 0)."""
    from PIL import Image

    kinds = [("RGB", (8, 8), "png"), ("RGB", (12, 10), "png"), ("L", (10, 12), "png"), ("RGB", (12, 10), "jpg")]
    for folder, n in folders.items():
        os.makedirs(root / folder)
        for i in range(n):
            mode, wh, ext = kinds[i % 4]
            Image.new(mode, wh, 7 * i + 1 if mode == "L" else (7 * i + 1,) * 3).save(root / folder / f"{i}.{ext}")
    (root / "classes.txt").write_text("bee\nant\n")
    return root


def hashes(root):
    """{path under root: sha256 of the file}."""
    import hashlib

    return {path: hashlib.sha256(data).hexdigest() for path, data in contents(root).items() if data is not None}


def layout_of(root):
    """{folder under root: sorted file names}, the folders only under train/ and test/."""
    return {
        os.path.relpath(d, root): sorted(fs) for s in ("train", "test") for d, _, fs in os.walk(os.path.join(root, s))
    }


@pytest.mark.parametrize("layout", sorted(RESIZE_LAYOUTS))
def test_prepare_data_resize_makes_one_size_and_keeps_the_layout(layout, tmp_path, capsys):
    folders = RESIZE_LAYOUTS[layout][0]
    src, out = resize_source(tmp_path / "src", folders), tmp_path / "new"
    before = hashes(src)
    code, err = run_prepare(["resize", "--src", src, "--size", "8", "--out", out], capsys)
    n, train = sum(folders.values()), sum(k for f, k in folders.items() if f.startswith("train"))
    assert code == 0 and err[-1] == f"{n} images written under {out} (train {train}, test {n - train})", err
    assert any("writing:" in line and f"/{n} [" in line for line in err)  # the progress bar
    assert hashes(src) == before and len(before) == n + 1  # the source untouched: every image and classes.txt
    assert layout_of(out) == layout_of(src)  # the same folders (groups, classes), file names and counts
    assert (out / "classes.txt").read_bytes() == b"bee\nant\n"
    for folder, k in folders.items():
        for i, name in enumerate(sorted(os.listdir(out / folder), key=lambda f: int(f.split(".")[0]))):
            with Image_open(out / folder / name) as im:
                assert im.size == (8, 8) and im.mode == "RGB" and im.format == ("JPEG" if i % 4 == 3 else "PNG")
                if i % 4 < 3:  # the grayscale one too: the same grey in the 3 channels, as open_rgb makes it
                    assert im.getpixel((4, 4)) == (7 * i + 1,) * 3, (folder, name)
    assert json.loads((out / ".cleanfl-prepared").read_text())["dataset"] == "resize"


@pytest.mark.parametrize("layout", sorted(RESIZE_LAYOUTS))
def test_prepare_data_resize_output_is_read_by_the_scripts(layout, tmp_path, monkeypatch, capsys):
    folders, flags = RESIZE_LAYOUTS[layout]
    src, out = resize_source(tmp_path / "src", folders), tmp_path / "new"
    assert prepare(["resize", "--src", src, "--size", "8", "--out", out], capsys)[0] == 0
    args, data, part = load("fedavg", ["--dataset", "folder", "--data-dir", out, "--model", "mlp", *flags],
                            monkeypatch)  # fmt: skip
    train = sum(k for f, k in folders.items() if f.startswith("train"))
    assert data.x_train.shape[1:] == (3, 8, 8) and data.classes == ["bee", "ant"] and len(data.y_train) == train


def test_prepare_data_resize_skips_strays_and_unreadable_images_and_keeps_empty_folders(tmp_path, capsys):
    src, out = resize_source(tmp_path / "src", {"train/ant": 2, "train/bee": 1, "test/ant": 1}), tmp_path / "new"
    os.makedirs(src / "test" / "bee")  # an empty test class folder: kept
    (src / ".cleanfl-cache.pt").write_bytes(b"\x80\x02")  # the scripts' cache of the old size: not copied
    (src / "train" / "ant" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    write_images(src / "train" / "ant" / ".thumbs", {"": 1})  # a hidden folder: skipped, its image too
    (src / "train" / "bee" / "broken.png").write_bytes(b"not a PNG")
    before = hashes(src)
    code, last = prepare(["resize", "--src", src, "--size", "4", "--out", out], capsys)
    assert code == 0 and last.startswith(f"4 images written under {out} (train 3, test 1); "), last
    assert "skipped 3 stray non-image files (.cleanfl-cache.pt, train/ant/.thumbs, train/ant/.DS_Store)" in last
    assert "skipped 1 unreadable image (train/bee/broken.png (UnidentifiedImageError))" in last
    assert files_under(out) == [".cleanfl-prepared", "classes.txt", "test/ant/0.png", "train/ant/0.png",
                                "train/ant/1.png", "train/bee/0.png"]  # fmt: skip
    assert os.listdir(out / "test" / "bee") == [] and hashes(src) == before


def test_prepare_data_resize_refusals(tmp_path, capsys):
    src = resize_source(tmp_path / "src", {"train/ant": 1, "test/ant": 1})
    os.makedirs(tmp_path / "flat" / "test" / "ant")  # no train/
    write_images(tmp_path / "flat", {"test/ant": 1})
    os.makedirs(tmp_path / "blank" / "train" / "ant")  # train/ and test/ without images
    os.makedirs(tmp_path / "blank" / "test" / "ant")
    (tmp_path / "blank" / "train" / "ant" / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    before = contents(tmp_path)
    for given, out, said in [
        (tmp_path / "flat", tmp_path / "new", f"--src: {tmp_path / 'flat'} has no train/ folder"),
        (tmp_path / "blank", tmp_path / "new", f"--src: no images under {tmp_path / 'blank' / 'train'} "),
        (tmp_path / "nothing", tmp_path / "new", f"--src: {tmp_path / 'nothing'} has no train/ or test/ folder"),
        (src, src / "small", f"--out: {src / 'small'} and --src {src} overlap"),  # --out inside --src
        (src, src, f"--out: {src} and --src {src} overlap"),
        (src / "train", src, f"--out: {src} and --src {src / 'train'} overlap"),  # --src inside --out
    ]:
        last = refused(["resize", "--src", given, "--size", "8", "--out", out], capsys)
        assert said in last, last
    for size, said in ((["--size", "0"], "argument --size: must be >= 1"), ([], "required: --size")):
        code, last = prepare(["resize", "--src", src, *size, "--out", tmp_path / "new"], capsys)
        assert code == 2 and said in last, last
    assert contents(tmp_path) == before and not partials(tmp_path) and not partials(src)


def test_prepare_data_resize_twice_into_one_out_needs_overwrite(tmp_path, capsys):
    src, out = resize_source(tmp_path / "src", {"train/ant": 2, "test/ant": 2}), tmp_path / "new"
    assert prepare(["resize", "--src", src, "--size", "8", "--out", out], capsys)[0] == 0
    first = contents(out)
    last = refused(["resize", "--src", src, "--size", "4", "--out", out], capsys)
    assert f"--out: {out} holds an earlier conversion" in last and "--overwrite" in last, last
    assert contents(out) == first
    code, last = prepare(["resize", "--src", src, "--size", "4", "--out", out, "--overwrite"], capsys)
    assert code == 0 and last == f"4 images written under {out} (train 2, test 2)", last
    for name in files_under(out / "train") + files_under(out / "test"):
        with Image_open(out / ("train" if name in files_under(out / "train") else "test") / name) as im:
            assert im.size == (4, 4)
    assert json.loads((out / ".cleanfl-prepared").read_text())["args"]["size"] == 4
