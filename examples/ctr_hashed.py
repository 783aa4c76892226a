"""Click-through-rate prediction over raw feature hashes, with an auto-growing hashed table.

    python examples/ctr_hashed.py            # a RemoteExecutor job: 1 trainer, 2 pservers
    python examples/ctr_hashed.py --local    # the same program under a plain Executor

Each example has 26 categorical fields whose values are raw 40-bit feature hashes:
a value's rank is drawn from a Zipf distribution (a few values are frequent, most
are rare) and hashed with its field into [0, 2^40). There is no vocabulary: the
embedding is `layers.sparse_embedding`, whose rows are created on the pservers as
ids are trained (after 2 sightings: `min_count=2`) and evicted when not trained
for 200 steps (a shrink every 50 steps). Clicks come from a hidden logistic model.
The MLP over the embeddings is examples/ctr_embedding.py's. The job prints the held-out AUC and, per pserver, the rows created and evicted and
the memory its table shard holds.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from ctr_embedding import auc, head
from tqdm import tqdm

import fluidps
from fluidps import layers, optimizer

FIELDS, DENSE, SPACE = 26, 13, 2**40
TABLE = "ctr_hashed.w"
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _scramble(x: np.ndarray) -> np.ndarray:
    """A fixed bijection-like mixing of uint64s (xorshift-multiply)."""
    x = x.astype(np.uint64)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    return x


class HashedClickWorld:
    """Raw feature hashes and the hidden logistic model clicks come from."""

    def __init__(self, seed: int = 2024):
        self.seed = np.uint64(seed)
        self.dense_weight = np.random.default_rng(seed).normal(0.0, 1.0, DENSE).astype(np.float32)

    def feature_hash(self, ranks: np.ndarray) -> np.ndarray:
        fields = np.arange(FIELDS, dtype=np.uint64)
        return (_scramble(ranks.astype(np.uint64) * _MIX + fields) % np.uint64(SPACE)).astype(np.int64)

    def weight(self, ids: np.ndarray) -> np.ndarray:
        """Each hash's hidden weight, uniform in [-1.7, 1.7) (variance about 1)."""
        unit = (_scramble(ids.astype(np.uint64) ^ self.seed) >> np.uint64(11)).astype(np.float64) / 2.0**53
        return (3.4 * unit - 1.7).astype(np.float32)

    def sample(self, n: int, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        ranks = np.minimum(rng.zipf(1.2, size=(n, FIELDS)), SPACE) - 1
        ids = self.feature_hash(ranks)
        dense = rng.normal(0.0, 1.0, (n, DENSE)).astype(np.float32)
        logit = 0.4 * self.weight(ids).sum(axis=1) + 0.3 * dense @ self.dense_weight - 0.5
        label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64).reshape(-1, 1)
        return {"ids": ids[..., None], "dense": dense, "label": label}


def build(embedding_dim: int = 8, learning_rate: float = 0.002, seed: int = 1):
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = seed
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [FIELDS, 1], dtype="int64")
        dense = layers.data("dense", [DENSE])
        label = layers.data("label", [1], dtype="int64")
        emb = layers.sparse_embedding(
            ids,
            [-1, embedding_dim],
            param_attr=fluidps.ParamAttr(name=TABLE),
            min_count=2,
            ttl_steps=200,
            shrink_every=50,
        )
        loss, prob = head(layers.reshape(emb, [-1, FIELDS * embedding_dim]), dense, label)
        test_program = main.clone(for_test=True)
        optimizer.Adam(learning_rate).minimize(loss)
    return main, startup, test_program, loss, prob


def train(
    train_examples: int = 200_000,
    test_examples: int = 20_000,
    batch_size: int = 512,
    pservers: int = 2,
    local: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    world = HashedClickWorld()
    train_data = world.sample(train_examples, seed=seed + 10)
    test_data = world.sample(test_examples, seed=seed + 20)
    main, startup, test_program, loss, prob = build(seed=seed + 1)
    exe = (
        fluidps.Executor()
        if local
        else fluidps.RemoteExecutor(fluidps.JobDesc(pservers=pservers, trainers=1))
    )
    try:
        exe.run(startup)
        steps = int(np.ceil(train_examples / batch_size))
        bar = tqdm(total=steps, desc="ctr_hashed", unit="step", disable=not progress)
        start = time.perf_counter()
        feeds = (
            {k: v[i : i + batch_size] for k, v in train_data.items()}
            for i in range(0, train_examples, batch_size)
        )
        # run_batches: each trainer holds its next batch and asks for its rows with this step's values
        for (loss_value,) in exe.run_batches(main, feeds, [loss]):
            bar.set_postfix(loss=f"{float(loss_value):.4f}")
            bar.update()
        seconds = time.perf_counter() - start
        bar.close()
        # Evaluation asks the pservers for the rows of the test ids only.
        (probabilities,) = exe.run(test_program, feed=test_data, fetch_list=[prob])
        if local:
            shards = {"local": {**exe.scope[TABLE].stats(), "rss_bytes": None}}
        else:
            shards = {
                ep: {**stats["hashed_tables"][name], "rss_bytes": stats["rss_bytes"]}
                for ep, stats in exe.pserver_stats().items()
                for name in stats["hashed_tables"]
            }
    finally:
        if not local:
            exe.close()
    return {
        "test_auc": auc(probabilities[:, 1], test_data["label"]),
        "final_loss": float(loss_value),
        "train_seconds": seconds,
        "samples_per_second": train_examples / seconds,
        "distinct_ids": len(np.unique(train_data["ids"])),
        "shards": shards,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train-examples", type=int, default=200_000)
    parser.add_argument("--test-examples", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--pservers", type=int, default=2)
    parser.add_argument("--local", action="store_true", help="train under a plain Executor")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    m = train(args.train_examples, args.test_examples, args.batch_size, args.pservers, args.local, args.seed)
    print(
        f"held-out AUC {m['test_auc']:.4f} ({m['train_seconds']:.1f}s, {m['samples_per_second']:,.0f} samples/s, "
        f"final loss {m['final_loss']:.4f}); {m['distinct_ids']:,} distinct ids in the training data"
    )
    for where, s in m["shards"].items():
        rss = f", process RSS {s['rss_bytes'] / 2**20:,.0f} MiB" if s["rss_bytes"] else ""
        print(
            f"  {where}: {s['rows']:,} rows held, {s['created']:,} created, {s['evicted']:,} evicted, "
            f"{s['pending_ids']:,} ids awaiting admission, table {s['bytes'] / 2**20:,.1f} MiB{rss}"
        )


if __name__ == "__main__":
    main()
