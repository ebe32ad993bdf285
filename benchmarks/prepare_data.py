"""Lay out datasets the scripts read as image folders in groups (--natural, --clients-per-domain), or resize one:

    python benchmarks/prepare_data.py isic --csv FLAMBY/.../train_test_split --images DIR --out ~/isic
    python benchmarks/prepare_data.py pacs --src ~/PACS --out ~/pacs
    python benchmarks/prepare_data.py femnist --train LEAF/data/femnist/data/train --test .../test --out ~/femnist
    python benchmarks/prepare_data.py celeba --train .../train --test .../test --images .../img_align_celeba --out DIR
    python benchmarks/prepare_data.py resize --src DIR --size N --out NEW

isic: FLamby's Fed-ISIC2019 (its train_test_split CSV, columns image, ..., target, center, fold, and its preprocessed
JPEGs) -> OUT/{train,test}/center<k>/class<y>/<image>.png, each image center-cropped to a square and resized to --size
(the scripts need one size; FLamby's preprocessed images keep their aspect ratio).
pacs: PACS as distributed in folders (SRC/<domain>/<class>/*) -> OUT/{train,test}/<domain>/<class>/*, a seeded
--test-frac of each domain's class held out as its test images (PACS has no test split in this layout), resized
to --size if given.
femnist, celeba: LEAF's JSON files ({"users", "num_samples", "user_data": {user: {"x", "y"}}}, split per user by
LEAF's `-t sample`) -> OUT/{train,test}/<user>/<class>/*.png, one client per user. FEMNIST: x is 784 values in
[0, 1] (28x28, row by row; 1.0 is the white background) written as 8-bit grayscale round(255 x), so dark ink on
white as in LEAF and the NIST scans (torchvision's EMNIST is the inverse, white on black); y in 0..61 (digits,
upper case, lower case). CelebA: x names an image of --images (LEAF's data/raw/img_align_celeba/), center-cropped
and resized to --size; y is 1 for smiling. Class folders are named <label>_<name> (FEMNIST: 00_0 ... 10_A ... 36_a
... 61_z, so A and a differ on a case-insensitive file system) and OUT/classes.txt lists them in label order: the
scripts read it (common.py: folder_layout), so every class keeps its LEAF label, even one without images.
resize: an image folder the scripts read (SRC/{train,test}/<class>/* or SRC/train/<group>/<class>/* with test/ per
group or shared) -> the same folders and file names under OUT, every image resized to --size x --size as pacs does
(stretched, not cropped) and made RGB as isic, pacs and celeba do (grayscale too); each keeps its name and is saved in
the format of its extension (JPEG and WebP re-encoded, GIF as a palette), every folder is kept (an empty test class
folder too) and SRC/classes.txt is copied unchanged; anything else at SRC's top (a .cleanfl-cache.pt) is a stray.
SRC is only read.

Every dataset: the input is checked before anything is written (exit 2 with a line naming the flag and the first
bad items; CSV and JSON files are read as UTF-8); --out must be new or empty, or with --overwrite an earlier
conversion: every folder written here holds a .cleanfl-prepared file (the conversion's arguments), and a non-empty
folder without one is never emptied. The images are written into a temporary folder beside --out, which replaces
--out only when complete (an interrupted or failed conversion leaves --out as it was) and gets the mode of the
folder it replaces, or the umask's. Stray files (.DS_Store, Thumbs.db, anything not an image) and images that
cannot be read are skipped and counted in the last line. Needs Pillow (installed with torchvision).
"""

import argparse
import csv
import json
import math
import os
import random
import shutil
import stat
import string
import sys
import tempfile

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import CLASSES_FILE, IMAGE_EXTENSIONS, inner_fraction, positive_int, refuse, seed_int  # noqa: E402

side = positive_int  # --size
ISIC_COLUMNS = ("image", "target", "center", "fold")
ISIC_CLASSES = ["class%d" % y for y in range(8)]  # FLamby's 8 diagnoses MEL, NV, BCC, AK, BKL, DF, VASC, SCC
ISIC_CENTERS = 6  # Fed-ISIC2019's 6 hospitals, 0..5
FLAMBY_SPLIT = "flamby/datasets/fed_isic2019/dataset_creation_scripts/train_test_split"
FEMNIST_CHARS = string.digits + string.ascii_uppercase + string.ascii_lowercase  # LEAF's labels 0..61
FEMNIST_CLASSES = ["%02d_%s" % (y, c) for y, c in enumerate(FEMNIST_CHARS)]  # 00_0 ... 10_A ... 36_a ... 61_z
CELEBA_CLASSES = ["0_not_smiling", "1_smiling"]
SKIPPED_DIRS = ("__MACOSX",)  # macOS zip metadata; hidden folders (.git, ...) are skipped too
MARKER = ".cleanfl-prepared"  # in every folder written here: --overwrite empties no folder without it (a home)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="dataset", required=True)

    def common_flags(s, size_default, size_help):
        s.add_argument("--out", required=True, help="the image folder to write (new or empty; see --overwrite)")
        s.add_argument("--overwrite", action="store_true",
            help=f"replace an earlier conversion in --out (a folder holding {MARKER}) once the new one is complete; "
                 "any other non-empty folder is refused")  # fmt: skip
        if size_help:
            s.add_argument("--size", type=side, default=size_default, help=size_help)

    isic = sub.add_parser("isic", help="FLamby's Fed-ISIC2019: the clients are its 6 centers")
    isic.add_argument("--csv", required=True,
        help=f"FLamby's train_test_split (columns image, ..., target, center, fold), in FLamby's source tree: "
             f"{FLAMBY_SPLIT}")  # fmt: skip
    isic.add_argument("--images", required=True, help="folder of FLamby's preprocessed <image>.jpg")
    common_flags(isic, 64, "side of the square images written (default: %(default)s)")
    pacs = sub.add_parser("pacs", help="PACS: 4 domains of 7 classes")
    pacs.add_argument("--src", required=True, help="SRC/<domain>/<class>/*")
    pacs.add_argument("--test-frac", type=inner_fraction, default=0.2,
        help="share of each domain's class held out for test, in (0, 1) (default: %(default)s)")  # fmt: skip
    pacs.add_argument("--seed", type=seed_int, default=0, help="seed of the held-out choice (default: %(default)s)")
    common_flags(pacs, None, "resize to this square side (default: keep)")
    resize = sub.add_parser("resize", help="an image folder the scripts read, every image resized to one size")
    resize.add_argument("--src", required=True, help="SRC/train/..., SRC/test/... (flat or in groups)")
    resize.add_argument("--size", type=side, required=True, help="side of the square images written")
    common_flags(resize, None, None)
    for name, what in (("femnist", "FEMNIST: a client per writer, 62 classes, 28x28 grayscale"),
                       ("celeba", "CelebA: a client per celebrity, smiling or not")):  # fmt: skip
        s = sub.add_parser(name, help=f"LEAF's {what}")
        s.add_argument("--train", required=True, help="LEAF's data/train/ folder of JSON files, or one JSON file")
        s.add_argument("--test", required=True, help="LEAF's data/test/ folder of JSON files, or one JSON file")
        if name == "celeba":
            s.add_argument("--images", required=True, help="LEAF's data/raw/img_align_celeba/ (CelebA's JPEGs)")
        common_flags(s, 64, "side of the square images written (default: %(default)s)" if name == "celeba" else None)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ reading
def hidden(name):
    return name.startswith(".") or name in SKIPPED_DIRS


def is_image(name):
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def open_rgb(path, size, crop):
    """The image at path as RGB (L, P and RGBA too), the central square if crop, resized to size x size if size."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
    if crop:
        s = min(im.size)
        left, top = (im.width - s) // 2, (im.height - s) // 2
        im = im.crop((left, top, left + s, top + s))
    return im.resize((size, size), Image.BILINEAR) if size else im


def femnist_image(x):
    """LEAF's 784 values in [0, 1], row by row, -> a 28x28 8-bit grayscale image of round(255 x)."""
    import numpy as np
    from PIL import Image

    a = np.asarray(x, dtype=np.float64)
    if a.shape != (784,) or not np.all((a >= 0) & (a <= 1)):  # NaN fails too
        raise ValueError("not 784 values in [0, 1]")
    return Image.fromarray(np.rint(a * 255).astype(np.uint8).reshape(28, 28), mode="L")


def read_text(flag, path, read):
    """read(f) of path opened as UTF-8 text (a BOM allowed), whatever the locale's encoding (Windows' cp1252 would
    misread LEAF's and FLamby's UTF-8); a file that is not UTF-8 (UTF-16, an image) is refused in one line."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            return read(f)
    except UnicodeDecodeError as e:
        refuse(f"{flag}: {path} is not UTF-8 text (byte {e.start:,}: {e.reason}); give the file itself, saved as UTF-8")
    except OSError as e:
        refuse(f"{flag}: cannot read {path} ({e.strerror})")


def plural(n, word):
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def listing(items, n=3):
    return ", ".join(map(str, items[:n])) + (" ..." if len(items) > n else "")


# ------------------------------------------------------------------------------------------------ the plans
class Plan:
    """What one conversion writes: items (a callable giving (path under --out, load) pairs, load() -> a PIL
    image, raising OSError / ValueError when the source cannot be read), their number, the class names in
    label order (OUT/classes.txt; None: the sorted folder names), stray files found, notes for the last line."""

    def __init__(self, items, total, classes=None, strays=(), notes=(), finish=None):
        self.items, self.total, self.classes = items, total, classes
        self.strays, self.notes, self.finish = list(strays), list(notes), finish


def isic_plan(a):
    path = os.path.expanduser(a.csv)
    if not os.path.isfile(path):
        refuse(f"--csv: no file {path}; FLamby's train_test_split is in FLamby's source tree: {FLAMBY_SPLIT}")
    try:
        header, rows = read_text("--csv", path, read_csv)
    except csv.Error as e:  # UTF-8 but not CSV (a field over csv's size limit, ...)
        refuse(f"--csv: {path} is not a CSV file ({e})")
    missing = [c for c in ISIC_COLUMNS if c not in header]
    if missing:
        looks = "fold" in missing and {"age_approx", "lesion_id", "dataset"} & set(header)
        what = " (FLamby's data-folder metadata, ISIC_2019_Training_Metadata_FL.csv?)" if looks else ""
        refuse(
            f"--csv: {path} has no column(s) {', '.join(missing)}{what}; give FLamby's train_test_split "
            f"(columns image,MEL,...,UNK,target,center,fold,fold2), in FLamby's source tree: {FLAMBY_SPLIT}"
        )
    if not rows:
        refuse(f"--csv: {path} lists no images")
    check_isic_rows(path, rows)
    images = os.path.expanduser(a.images)
    if not os.path.isdir(images):
        refuse(f"--images: no folder {images} (FLamby's ISIC_2019_Training_Input_preprocessed)")
    present = set(os.listdir(images))
    absent = [r["image"] + ".jpg" for r in rows if r["image"] + ".jpg" not in present]
    if absent:
        refuse(f"--images: {len(absent):,} of the {len(rows):,} images --csv lists are not in {images}: "
               f"{listing(absent)}")  # fmt: skip

    def items():
        for r in rows:
            dst = os.path.join(r["fold"], f"center{r['center']}", f"class{r['target']}", r["image"] + ".png")
            src = os.path.join(images, r["image"] + ".jpg")
            yield dst, lambda src=src: open_rgb(src, a.size, crop=True)

    return Plan(items, len(rows), ISIC_CLASSES)


def read_csv(f):
    """(header, rows as dicts) of an open CSV file."""
    reader = csv.DictReader(f)
    return reader.fieldnames or [], list(reader)


def check_isic_rows(path, rows):
    """Every row image,target,center,fold with target and center in range (a target of 9 would give classes.txt
    10 classes and the model 10 outputs, silently), each image on one row (one in a train and a test row would be
    written to both: test images in training). target and center become ints (so "07" is class7)."""
    seen = {}  # image -> (line, fold)
    for n, r in enumerate(rows, 2):  # line 1 is the header
        r.update({k: (r[k] or "").strip() for k in ISIC_COLUMNS})  # a short row has None in its last columns
        given = f"{r['image']},{r['target']},{r['center']},{r['fold']}"
        digits = all(r[k].isascii() and r[k].isdigit() for k in ("target", "center"))
        if not (r["image"] and r["fold"] in ("train", "test") and digits):
            refuse(f"--csv: line {n} of {path} is not image,target (0..7),center (0..5),fold (train or test): {given}")
        for key, count, what in (("target", len(ISIC_CLASSES), "diagnoses"), ("center", ISIC_CENTERS, "centers")):
            r[key] = int(r[key])
            if r[key] >= count:
                refuse(f"--csv: line {n} of {path}: {key} {r[key]} is not in 0..{count - 1} ({count} {what}): {given}")
        if r["image"] in seen:
            m, fold = seen[r["image"]]
            refuse(
                f"--csv: the image {r['image']} is on line {m} ({fold}) and line {n} ({r['fold']}) of {path}; each "
                "image must be listed once (an image in train and test would put test images in training)"
            )
        seen[r["image"]] = n, r["fold"]


def pacs_plan(a):
    src = os.path.expanduser(a.src)
    if not os.path.isdir(src):
        refuse(f"--src: no folder {src} (PACS as distributed: SRC/<domain>/<class>/*)")
    strays, chosen = [], []  # chosen: (split, domain, class, file name)
    rng = random.Random(a.seed)

    def entries(path):  # (sub-folders, image files); strays recorded
        dirs, images = [], []
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if os.path.isdir(full):
                (strays.append(os.path.relpath(full, src)) if hidden(name) else dirs.append(name))
            elif is_image(name):
                images.append(name)
            else:
                strays.append(os.path.relpath(full, src))
        return dirs, images

    domains, loose = entries(src)
    strays += [os.path.relpath(os.path.join(src, f), src) for f in loose]
    if not domains:
        refuse(f"--src: {src} has no domain folders; PACS as distributed is SRC/<domain>/<class>/*")
    for domain in domains:
        classes, loose = entries(os.path.join(src, domain))
        strays += [os.path.join(domain, f) for f in loose]
        if not classes:
            refuse(f"--src: {os.path.join(src, domain)} has no class folders; PACS is SRC/<domain>/<class>/*")
        for cls in classes:
            nested, files = entries(os.path.join(src, domain, cls))
            if nested and not files:
                refuse(
                    f"--src: {os.path.join(src, domain, cls)} holds folders, not images: give the folder whose "
                    f"sub-folders are the domains (SRC/<domain>/<class>/*), e.g. --src {os.path.join(src, domain)}"
                )
            strays += [os.path.join(domain, cls, d) for d in nested]
            test = set(rng.sample(files, round(a.test_frac * len(files))))
            chosen += [("test" if f in test else "train", domain, cls, f) for f in files]
    if not chosen:
        refuse(f"--src: no images under {src}/<domain>/<class>/ (extensions {', '.join(IMAGE_EXTENSIONS)})")

    def items():
        for split, domain, cls, name in chosen:
            path = os.path.join(src, domain, cls, name)
            yield (
                os.path.join(split, domain, cls, os.path.splitext(name)[0] + ".png"),
                lambda path=path: open_rgb(path, a.size, crop=False),
            )

    return Plan(items, len(chosen), None, strays)


def resize_plan(a):
    """Every image under SRC/train/ and SRC/test/ at its own path, every folder kept, classes.txt copied."""
    src = os.path.expanduser(a.src)
    absent = [s + "/" for s in ("train", "test") if not os.path.isdir(os.path.join(src, s))]
    if absent:
        refuse(f"--src: {src} has no {' or '.join(absent)} folder; give an image folder the scripts read "
               "(SRC/train/<class>/* or SRC/train/<group>/<class>/*, and SRC/test/)")  # fmt: skip
    keep = ("train", "test", CLASSES_FILE)
    strays = sorted(f for f in os.listdir(src) if f not in keep)
    folders, chosen = [], []  # paths under src
    for split in ("train", "test"):
        before = len(chosen)
        for d, dirs, files in os.walk(os.path.join(src, split), followlinks=True):
            rel = os.path.relpath(d, src)
            strays += [os.path.join(rel, x) for x in sorted(dirs) if hidden(x)]
            dirs[:] = sorted(x for x in dirs if not hidden(x))
            folders.append(rel)
            for f in sorted(files):
                (chosen if is_image(f) else strays).append(os.path.join(rel, f))
        if len(chosen) == before:
            refuse(f"--src: no images under {os.path.join(src, split)} (extensions {', '.join(IMAGE_EXTENSIONS)})")
    classes = os.path.join(src, CLASSES_FILE)

    def items():
        for rel in chosen:
            yield rel, lambda path=os.path.join(src, rel): open_rgb(path, a.size, crop=False)

    def finish(tmp, notes):
        for rel in folders:  # a folder whose images were all unreadable, an empty test class folder: kept
            os.makedirs(os.path.join(tmp, rel), exist_ok=True)
        if os.path.isfile(classes):
            shutil.copyfile(classes, os.path.join(tmp, CLASSES_FILE))

    return Plan(items, len(chosen), None, strays, finish=finish)


def leaf_files(flag, value):
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        refuse(f"{flag}: no file or folder {path} (LEAF's data/{flag[2:]}/ of JSON files)")
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".json") and not f.startswith("."))
    if not files:
        refuse(f"{flag}: {path} holds no .json files (LEAF's data/{flag[2:]}/, written by its preprocess.sh)")
    return files


def read_leaf(flag, path):
    try:
        data = read_text(flag, path, json.load)  # a file that is not UTF-8 is refused there
    except ValueError as e:
        refuse(f"{flag}: cannot read {path} as JSON ({type(e).__name__}: {str(e)[:80]})")
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("users"), list)
        or not isinstance(data.get("user_data"), dict)
    ):
        refuse(f'{flag}: {path} is not LEAF\'s JSON ({{"users": [...], "user_data": {{user: {{"x", "y"}}}}}})')
    return data


def label_ok(y, num_classes):
    """LEAF's labels: integers (FEMNIST) or integral floats (CelebA's 0.0 / 1.0) in 0..num_classes-1."""
    number = isinstance(y, (int, float)) and not isinstance(y, bool) and math.isfinite(y)
    return number and y == int(y) and 0 <= y < num_classes


def scan_leaf(flag, files, dataset, num_classes):
    """Check LEAF's files before anything is written: every user's x and y lists of one length, the labels in
    0..num_classes-1, the first x of the dataset's kind, user names usable as folder names, no two users differing
    in case only. Returns ({user: number of samples}, the x of every sample if CelebA's: its image names)."""
    counts, first, names = {}, True, []
    for path in files:
        data = read_leaf(flag, path)
        for user in data["users"]:
            d = data["user_data"].get(user)
            if not isinstance(d, dict) or not isinstance(d.get("x"), list) or not isinstance(d.get("y"), list):
                refuse(f"{flag}: {path}: user {user} has no x and y lists in user_data")
            if len(d["x"]) != len(d["y"]):
                refuse(f"{flag}: {path}: user {user} has {len(d['x'])} x but {len(d['y'])} y")
            bad = [y for y in d["y"] if not label_ok(y, num_classes)]
            if bad:
                refuse(f"{flag}: {path}: user {user} has labels outside 0..{num_classes - 1} of {dataset}: {bad[:3]}")
            if first and d["x"]:
                x = d["x"][0]
                kind = isinstance(x, str) if dataset == "celeba" else isinstance(x, list) and len(x) == 784
                if not kind:
                    want = "an image file name" if dataset == "celeba" else "a list of 784 pixel values"
                    refuse(f"{flag}: {path} is not LEAF's {dataset}: its first x is not {want} ({str(x)[:40]})")
                first = False
            name = str(user)
            if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith("."):
                refuse(f"{flag}: {path}: the user name {name!r} cannot be a folder name")
            counts[name] = counts.get(name, 0) + len(d["y"])
            names += map(str, d["x"]) if dataset == "celeba" else []
    if not counts:
        refuse(f"{flag}: no users in {listing(files, 2)}")
    folded = {}
    for user in counts:
        folded.setdefault(user.lower(), []).append(user)
    clash = [u for group in folded.values() if len(group) > 1 for u in group]
    if clash:
        refuse(f"{flag}: users differing only in case would share a folder on a case-insensitive file system: "
               f"{listing(sorted(clash))}")  # fmt: skip
    return counts, names


def leaf_plan(a):
    dataset = a.dataset
    classes = FEMNIST_CLASSES if dataset == "femnist" else CELEBA_CLASSES
    files = {split: leaf_files(f"--{split}", getattr(a, split)) for split in ("train", "test")}
    scans = {split: scan_leaf(f"--{split}", files[split], dataset, len(classes)) for split in files}
    counts = {split: scan[0] for split, scan in scans.items()}
    images = None
    if dataset == "celeba":
        images = os.path.expanduser(a.images)
        if not os.path.isdir(images):
            refuse(f"--images: no folder {images} (LEAF's data/raw/img_align_celeba/)")
        present, listed = set(os.listdir(images)), scans["train"][1] + scans["test"][1]
        absent = [x for x in listed if x not in present]
        if absent:
            refuse(f"--images: {len(absent):,} of the {len(listed):,} images LEAF's JSON names are not in {images}: "
                   f"{listing(absent)}")  # fmt: skip
    per_user = set(counts["train"]) == set(counts["test"])
    notes = [] if per_user else [
        f"the test users are not the training users (LEAF's -t user split?): one shared test/<class>/ of "
        f"{plural(sum(counts['test'].values()), 'image')}"
    ]  # fmt: skip

    def items():
        seen = {}
        for split in ("train", "test"):
            for path in files[split]:
                data = read_leaf(f"--{split}", path)
                for user in data["users"]:
                    d = data["user_data"][user]
                    for x, y in zip(d["x"], d["y"]):
                        folder = os.path.join(split, str(user) if split == "train" or per_user else "", classes[int(y)])
                        if dataset == "femnist":  # the k-th image of this user and split
                            k = seen[split, user] = seen.get((split, user), -1) + 1
                            yield os.path.join(folder, f"{user}_{k:05d}.png"), lambda x=x: femnist_image(x)
                        else:  # CelebA's own file name
                            yield (
                                os.path.join(folder, os.path.splitext(str(x))[0] + ".png"),
                                lambda x=x: open_rgb(os.path.join(images, str(x)), a.size, crop=True),
                            )

    def finish(tmp, notes):
        """Per-user test folders: a test/<user>/ for every client (empty where all its test images were unreadable),
        none for a user left without training images."""
        if not per_user:
            for c in classes:  # the scripts' shared test/ needs a folder per class
                os.makedirs(os.path.join(tmp, "test", c), exist_ok=True)
            return
        train, test = (set(os.listdir(os.path.join(tmp, s))) if os.path.isdir(os.path.join(tmp, s)) else set()
                       for s in ("train", "test"))  # fmt: skip
        for user in sorted(test - train):
            shutil.rmtree(os.path.join(tmp, "test", user))
        if test - train:
            notes.append(f"left out the test images of {plural(len(test - train), 'user')} without training images")
        for user in train - test:
            os.makedirs(os.path.join(tmp, "test", user))

    total = sum(map(sum, (c.values() for c in counts.values())))
    return Plan(items, total, classes, notes=notes, finish=finish)


PLANS = {"isic": isic_plan, "pacs": pacs_plan, "femnist": leaf_plan, "celeba": leaf_plan, "resize": resize_plan}


# ------------------------------------------------------------------------------------------------ writing
def refuse_foreign(out):
    """Refuse a non-empty out that prepare_data.py did not write (no MARKER in it): --overwrite would delete what
    it holds (a folder of notes; --out ~ a home directory)."""
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if held and not os.path.isfile(os.path.join(out, MARKER)):
        refuse(
            f"--out: {out} holds {listing(held)} and is not a prepare_data.py output (it has no {MARKER}); it is "
            "never emptied, with or without --overwrite: give a new or empty folder"
        )


def check_out(a):
    """--out: new, or an empty folder, or (with --overwrite) an earlier conversion to replace; never a file, a
    link, a folder of other files, or a folder holding an input. Returns its absolute path."""
    out = os.path.abspath(os.path.expanduser(a.out))
    if os.path.islink(out) or (os.path.exists(out) and not os.path.isdir(out)):
        refuse(f"--out: {out} is {'a link' if os.path.islink(out) else 'a file'}; give a folder")
    for flag in ("csv", "images", "src", "train", "test"):
        given = getattr(a, flag, None)
        if given is None:
            continue
        path = os.path.abspath(os.path.expanduser(given))
        if path == out or path.startswith(out + os.sep) or out.startswith(path + os.sep):
            refuse(f"--out: {out} and --{flag} {path} overlap; write the images somewhere else")
    refuse_foreign(out)
    if os.path.isdir(out) and os.listdir(out) and not a.overwrite:
        refuse(
            f"--out: {out} holds an earlier conversion ({MARKER}); give --overwrite to replace it, or an empty or "
            "new folder (never two conversions in one folder: their train and test images would mix)"
        )
    return out


def folder_mode(out, tmp):
    """The mode for tmp, the folder that becomes out: out's own if out exists (an empty folder made for it, maybe
    group-writable), else 0o777 less the umask as for any new folder (mkdtemp makes tmp 0o700: private), keeping
    the special bits mkdir gave tmp (a parent's setgid)."""
    if os.path.isdir(out):
        return stat.S_IMODE(os.stat(out).st_mode)
    umask = os.umask(0)  # the only way to read it
    os.umask(umask)
    return (stat.S_IMODE(os.stat(tmp).st_mode) & ~0o777) | (0o777 & ~umask)


def write(plan, out, stamp):
    """Write the plan into a temporary folder beside out, with stamp (the conversion's arguments) in its MARKER,
    then put it in out's place. Returns (written, unreadable names)."""
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    written, unreadable = 0, []
    try:
        bar = tqdm(total=plan.total, desc="writing", unit="img", file=sys.stderr, mininterval=1.0, leave=False)
        for name, load in plan.items():
            bar.update()
            try:
                im = load()
            except (OSError, ValueError, SyntaxError) as e:  # PIL: UnidentifiedImageError, truncated files, ...
                unreadable.append(f"{name} ({type(e).__name__})")
                continue
            dst = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            im.save(dst)  # outside the try: a full disk stops the conversion rather than skipping images
            written += 1
        bar.close()
        if not written:
            refuse(f"--out: none of the {plan.total:,} images could be read; nothing written")
        if plan.classes:
            with open(os.path.join(tmp, CLASSES_FILE), "w") as f:
                f.write("".join(c + "\n" for c in plan.classes))
        if plan.finish:
            plan.finish(tmp, plan.notes)
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            f.write(stamp)
        os.chmod(tmp, folder_mode(out, tmp))
        refuse_foreign(out)  # again: files may have been put into out while the images were written
        if os.path.isdir(out):
            shutil.rmtree(out)  # empty, or an earlier conversion and --overwrite
        os.rename(tmp, out)
    except BaseException:  # Ctrl-C too: no half-written output is left, --out is as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written, unreadable


def main(argv=None):
    a = parse_args(argv)
    out = check_out(a)
    plan = PLANS[a.dataset](a)  # reads and checks the input; nothing is written before this returns
    stamp = json.dumps({"prepared by": "benchmarks/prepare_data.py", "dataset": a.dataset, "args": vars(a)}, indent=1)
    written, unreadable = write(plan, out, stamp + "\n")
    counts = {s: sum(len(fs) for _, _, fs in os.walk(os.path.join(out, s))) for s in ("train", "test")}
    line = f"{written:,} images written under {out} (train {counts['train']:,}, test {counts['test']:,})"
    if plan.strays:
        line += f"; skipped {plural(len(plan.strays), 'stray non-image file')} ({listing(plan.strays)})"
    if unreadable:
        line += f"; skipped {plural(len(unreadable), 'unreadable image')} ({listing(unreadable)})"
    print("; ".join([line, *plan.notes]), file=sys.stderr)
    return written


if __name__ == "__main__":
    main()
