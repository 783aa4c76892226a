"""Real clicks in the order they happened: MovieLens-100K replayed as a click stream.

    pip install --no-deps recbole                    # ships the data set; no download at run time
    python examples/movielens_streaming.py           # all 100,000 ratings, in seconds
    python examples/movielens_streaming.py --ratings 20000

An online recommender sees its events in time order, and is judged on each one before
it trains on it. Here the ratings of MovieLens-100K, sorted by their timestamps, are
appended to a segment log (fluidps.io.StreamLog, each record stamped with its rating's
time); a rating of 4 or 5 is a click. The program reads the log in windows
(layers.stream_reader, follow=False) and trains examples/ctr_streaming.py's model: an
`is_sparse` embedding of the hashed user, item and genre ids under a small MLP, with
lazy Adam. Each batch's predictions are fetched from the same run that trains on it,
and the forward pass runs before the update, so every rating is scored by a model that
has not seen it: the **progressive** (predict-then-train) AUC over the whole stream.

Next to it, the same model (same seed, batch size, one pass) is trained offline on a
random 80% of the ratings and scored on the other 20%. A random split lets the model
learn from a user's later ratings before it is asked about their earlier ones, which
no online system can, so the offline AUC is the optimistic one.

MovieLens-100K: F. M. Harper and J. A. Konstan, The MovieLens Datasets: History and
Context, ACM TiiS 5(4), 2015. The files come from RecBole's package
(recbole/dataset_example/ml-100k), which is read, never imported: importing recbole
imports torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import numpy as np
from ctr_embedding import auc

import fluidps
from fluidps import layers, optimizer
from fluidps.errors import DatasetError

BUCKETS = 2**18  # hashed rows: ML-100K's 2,625 user and item ids land on 2,607 of them
DIM = 8
CLICK_RATING = 4  # a rating of 4 or more is a click
USER, ITEM, GENRE = 1, 2, 3  # each field hashes into the same rows, apart by its tag
_MIX = np.uint64(0x9E3779B97F4A7C15)


def movielens_dir() -> Path:
    """recbole's copy of ML-100K, found without importing recbole (find_spec runs no code)."""
    spec = importlib.util.find_spec("recbole")
    folder = None
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations))) / "dataset_example" / "ml-100k"
    if folder is None or not (folder / "ml-100k.inter").is_file():
        raise DatasetError(
            "MovieLens-100K is read from the recbole package's copy (no download): "
            "pip install --no-deps recbole"
        )
    return folder


def _columns(header: str, path: Path, wanted: list[str]) -> list[int]:
    """Where each wanted column is in a RecBole atomic file's typed header (`name:type`)."""
    names = [column.split(":")[0] for column in header.rstrip("\n").split("\t")]
    missing = [name for name in wanted if name not in names]
    if missing:
        raise DatasetError(f"{path}: no column {', '.join(missing)} (its header: {header.strip()})")
    return [names.index(name) for name in wanted]


def load_ratings(folder: Path | None = None) -> dict[str, np.ndarray]:
    """MovieLens-100K's ratings sorted by time (ties in file order): `user`, `item`,
    `rating`, `timestamp` (seconds) and `genres` (each rating's film's genre indices,
    padded with -1 to the most genres a film has), plus `genre_names`."""
    folder = folder or movielens_dir()
    inter = folder / "ml-100k.inter"
    with inter.open() as f:
        columns = _columns(f.readline(), inter, ["user_id", "item_id", "rating", "timestamp"])
        table = np.loadtxt(f, delimiter="\t", usecols=columns, dtype=np.float64, ndmin=2)
    user, item, rating, timestamp = table.T
    genres_of = _film_genres(folder / "ml-100k.item")
    names = sorted({g for genres in genres_of.values() for g in genres})
    width = max(len(genres) for genres in genres_of.values())
    padded = {film: [names.index(g) for g in gs] + [-1] * (width - len(gs)) for film, gs in genres_of.items()}
    order = np.argsort(timestamp, kind="stable")
    item = item.astype(np.int64)[order]
    return {
        "user": user.astype(np.int64)[order],
        "item": item,
        "rating": rating.astype(np.float32)[order],
        "timestamp": timestamp[order],
        "genres": np.array([padded.get(film, [-1] * width) for film in item.tolist()], np.int64),
        "genre_names": np.array(names),
    }


def _film_genres(path: Path) -> dict[int, list[str]]:
    with path.open() as f:
        item, genres = _columns(f.readline(), path, ["item_id", "class"])
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    return {int(row[item]): row[genres].split() if len(row) > genres else [] for row in rows}


def hashed(field: int, values: np.ndarray) -> np.ndarray:
    """Ids hashed with their field into rows [1, BUCKETS) (row 0 is padding: a film's
    missing genres); a fixed xorshift-multiply, the same in every process."""
    x = values.astype(np.uint64) * _MIX + np.uint64(field)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    rows = (x % np.uint64(BUCKETS - 1) + np.uint64(1)).astype(np.int64)
    return np.where(values < 0, 0, rows)


def click_records(ratings: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The stream's records: hashed [user, item, genre...] ids and whether it was a click."""
    ids = np.concatenate(
        [hashed(USER, ratings["user"])[:, None], hashed(ITEM, ratings["item"])[:, None],
         hashed(GENRE, ratings["genres"])], axis=1,
    )  # fmt: skip
    return {"ids": ids, "click": (ratings["rating"] >= CLICK_RATING).astype(np.int64).reshape(-1, 1)}


def build(fields: int, stream: str | None, batch_size: int):
    """ctr_streaming's model over `fields` hashed ids; read from `stream` when given, else fed."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [fields], dtype="int64")
        click = layers.data("click", [1], dtype="int64")
        emb = layers.embedding_v2(ids, [BUCKETS, DIM], is_sparse=True, padding_idx=0)
        h = layers.fc(layers.reshape(emb, [-1, fields * DIM]), 16, act="relu")
        prob = layers.softmax(layers.fc(h, 2))
        loss = layers.mean(layers.cross_entropy(prob, click))
        test_program = main.clone(for_test=True)
        optimizer.Adam(0.01, lazy_mode=True).minimize(loss)
        if stream is not None:
            layers.stream_reader(stream, [ids, click], batch_size, window_records=4096, follow=False)
    return main, startup, test_program, prob, click


def progressive(records: dict[str, np.ndarray], timestamps: np.ndarray, root: Path, batch_size: int) -> dict:
    """Append the records to a log in time order, train from it, and score each batch before
    training on it (the fetched probabilities come from the forward pass, before the update)."""
    log = fluidps.io.StreamLog(root / "ratings")
    log.append(records, timestamp=timestamps)
    main, startup, _, prob, click = build(records["ids"].shape[1], f"log:{log.path}", batch_size)
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    scores, labels = [], []
    while True:
        try:
            p, c = exe.run(main, fetch_list=[prob, click], scope=scope)
        except fluidps.EOFException:
            break
        scores.append(p[:, 1])
        labels.append(c)
    return {
        "auc": auc(np.concatenate(scores), np.concatenate(labels)),
        "appended": log.end_offset(),
        "scored": sum(len(s) for s in scores),
        "committed": log.committed("trainers"),
    }


def offline(records: dict[str, np.ndarray], batch_size: int, epochs: int, seed: int = 0) -> dict:
    """The same model trained on a random 80% (shuffled each pass), scored on the other 20%."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(records["click"]))
    cut = int(0.8 * len(order))
    train, test = order[:cut], order[cut:]
    main, startup, test_program, prob, _ = build(records["ids"].shape[1], None, batch_size)
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    for _ in range(epochs):
        shuffled = rng.permutation(train)
        for i in range(0, len(shuffled), batch_size):
            batch = shuffled[i : i + batch_size]
            exe.run(main, feed={k: v[batch] for k, v in records.items()}, scope=scope)
    feed = {"ids": records["ids"][test], "click": records["click"][test]}
    (p,) = exe.run(test_program, feed=feed, fetch_list=[prob], scope=scope)
    return {"auc": auc(p[:, 1], records["click"][test]), "train": len(train), "test": len(test)}


def run(
    ratings: int | None = None,
    batch_size: int = 256,
    offline_epochs: int = 1,
    workdir: str | None = None,
    verbose: bool = True,
) -> dict:
    """Progressive AUC over the first `ratings` ratings in time order (None: all), and the
    offline AUC of the same model on a random 80/20 split of them. Returns both, with
    the counts appended, scored and committed."""
    start = time.perf_counter()
    data = load_ratings()
    count = len(data["user"]) if ratings is None else min(ratings, len(data["user"]))
    records = {k: v[:count] for k, v in click_records(data).items()}
    root = Path(workdir or tempfile.mkdtemp(prefix="movielens-streaming-"))
    online = progressive(records, data["timestamp"][:count], root, batch_size)
    held_out = offline(records, batch_size, offline_epochs)
    result = {
        "ratings": count,
        "click_rate": float(records["click"].mean()),
        "progressive_auc": online["auc"],
        "offline_auc": held_out["auc"],
        "appended": online["appended"],
        "scored": online["scored"],
        "committed": online["committed"],
        "seconds": time.perf_counter() - start,
        "dir": str(root),
    }
    if verbose:
        print(f"{count:,} MovieLens-100K ratings in time order, {result['click_rate']:.1%} clicks (rating >= 4)")  # fmt: skip
        print(f"progressive AUC (each batch scored, then trained on): {result['progressive_auc']:.4f} "
              f"over {result['scored']:,} ratings streamed from {root / 'ratings'}")  # fmt: skip
        print(f"offline AUC (random 80/20 split, {offline_epochs} pass{'es' * (offline_epochs > 1)}): "
              f"{result['offline_auc']:.4f} on {held_out['test']:,} held-out ratings")  # fmt: skip
        print(f"{result['seconds']:.1f}s")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ratings", type=int, help="the first N ratings in time order (default: all)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--offline-epochs", type=int, default=1)
    parser.add_argument("--dir", help="where the log goes (default: a temporary directory)")
    args = parser.parse_args()
    run(args.ratings, args.batch_size, args.offline_epochs, args.dir)


if __name__ == "__main__":
    main()
