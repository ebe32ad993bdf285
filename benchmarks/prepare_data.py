"""Lay out datasets the scripts read as image folders in groups (--natural, --clients-per-domain):

    python benchmarks/prepare_data.py isic --csv CSV --images DIR --out ~/isic
    python benchmarks/prepare_data.py pacs --src ~/PACS --out ~/pacs

isic: FLamby's Fed-ISIC2019 (its metadata CSV with columns image, target, center, fold and its preprocessed JPEGs)
-> OUT/{train,test}/center<k>/class<y>/<image>.png, each image center-cropped to a square and resized to --size
(the scripts need one size; FLamby's preprocessed images keep their aspect ratio).
pacs: PACS as distributed in folders (SRC/<domain>/<class>/*) -> OUT/{train,test}/<domain>/<class>/*, a seeded
--test-frac of each domain's class held out as its test images (PACS has no test split in this layout), resized
to --size if given. Needs Pillow (installed with torchvision).
"""

import argparse
import csv
import os
import random
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="dataset", required=True)
    isic = sub.add_parser("isic", help="FLamby's Fed-ISIC2019: the clients are its 6 centers")
    isic.add_argument("--csv", required=True, help="FLamby's metadata CSV (image, target, center, fold)")
    isic.add_argument("--images", required=True, help="folder of FLamby's preprocessed <image>.jpg")
    isic.add_argument("--out", required=True, help="the image folder to write")
    isic.add_argument("--size", type=int, default=64, help="side of the square images written")
    pacs = sub.add_parser("pacs", help="PACS: 4 domains of 7 classes")
    pacs.add_argument("--src", required=True, help="SRC/<domain>/<class>/*")
    pacs.add_argument("--out", required=True, help="the image folder to write")
    pacs.add_argument("--test-frac", type=float, default=0.2, help="share of each domain's class held out for test")
    pacs.add_argument("--size", type=int, default=None, help="resize to this square side (default: keep)")
    pacs.add_argument("--seed", type=int, default=0, help="seed of the held-out choice")
    return p.parse_args(argv)


def save(src, dst, size, crop):
    from PIL import Image

    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with Image.open(src) as im:
        im = im.convert("RGB")
        if crop:  # the central square
            s = min(im.size)
            left, top = (im.width - s) // 2, (im.height - s) // 2
            im = im.crop((left, top, left + s, top + s))
        if size:
            im = im.resize((size, size), Image.BILINEAR)
        im.save(dst)


def isic(a):
    with open(a.csv) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        dst = os.path.join(a.out, r["fold"], f"center{r['center']}", f"class{r['target']}", r["image"] + ".png")
        save(os.path.join(a.images, r["image"] + ".jpg"), dst, a.size, crop=True)
    return len(rows)


def pacs(a):
    rng, n = random.Random(a.seed), 0
    for domain in sorted(os.listdir(a.src)):
        for cls in sorted(os.listdir(os.path.join(a.src, domain))):
            files = sorted(os.listdir(os.path.join(a.src, domain, cls)))
            test = set(rng.sample(files, round(a.test_frac * len(files))))
            for name in files:
                split = "test" if name in test else "train"
                stem = os.path.splitext(name)[0]
                save(
                    os.path.join(a.src, domain, cls, name),
                    os.path.join(a.out, split, domain, cls, stem + ".png"),
                    a.size,
                    crop=False,
                )
                n += 1
    return n


def main(argv=None):
    a = parse_args(argv)
    n = {"isic": isic, "pacs": pacs}[a.dataset](a)
    print(f"{n} images written under {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
