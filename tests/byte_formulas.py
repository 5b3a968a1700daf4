"""Bytes each rank should move, written out from the algorithms' descriptions.

Nothing here calls gnnpar's own byte formulas (``comm.ring_bytes``, the layers' schedules,
``expected_bytes``, the planner): the tests hold gnnpar's measured traffic against these, so a
wrong factor in the implementation's formulas cannot hide behind the same factor here.

Ring costs (docs/grid.md, per rank, a group of p ranks, a full buffer of V bytes): all-gather and
reduce-scatter (p−1)/p·V, all-reduce 2(p−1)/p·V, broadcast (p−1)/p·V (what a rank receives
on average), all-to-all the bytes a rank sends to the others. Uneven pieces are padded to
the largest before they move, so V counts the padding. Chunks are balanced, the first ranks
one larger (``n = 7`` over 3 ranks: 3, 2, 2).

Results are ``{axis: {kind: bytes}}``, the shape of ``Traffic.as_dict()``; zero entries are
left out, as a collective over one rank moves nothing and is not recorded.
"""

from __future__ import annotations

from collections import defaultdict

INT64, INT32 = 8, 4
#: The (outer, inner, depth) axis roles of a 3D layer, rotating with the layer index.
ROLES = (("x", "y", "z"), ("z", "x", "y"), ("y", "z", "x"))


def gather_bytes(p: int, full: float) -> float:
    """All-gather or reduce-scatter of a full (padded) buffer of ``full`` bytes."""
    return (p - 1) / p * full


def all_reduce_bytes(p: int, full: float) -> float:
    """All-reduce of ``full`` bytes: a reduce-scatter then an all-gather."""
    return 2 * (p - 1) / p * full


def broadcast_bytes(p: int, full: float) -> float:
    """Broadcast of ``full`` bytes: each rank receives (p−1)/p of it on average."""
    return (p - 1) / p * full


def chunk(n: int, parts: int, index: int) -> int:
    """Size of chunk ``index`` when ``n`` items are split into ``parts`` balanced chunks."""
    return n // parts + (1 if index < n % parts else 0)


def chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` (the chunks before it come first)."""
    start = sum(chunk(n, parts, i) for i in range(index))
    return start, start + chunk(n, parts, index)


def biggest(n: int, parts: int) -> int:
    """The largest chunk: what every piece is padded to."""
    return -(-n // parts)


class Bytes:
    """Accumulates formula bytes by axis and kind, and the number of collectives (each
    recorded collective rounds its fractional ring bytes once)."""

    def __init__(self) -> None:
        self.bytes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def add(self, axis: str, kind: str, p: int, full_bytes: float) -> None:
        """One collective of ``kind`` over ``axis`` (``p`` ranks) on ``full_bytes``."""
        if p <= 1:
            return
        formula = {
            "all_gather": gather_bytes,
            "reduce_scatter": gather_bytes,
            "all_reduce": all_reduce_bytes,
            "broadcast": broadcast_bytes,
        }[kind]
        self.bytes[axis][kind] += formula(p, full_bytes)
        self.calls[axis][kind] += 1

    def check(self, measured: dict[str, dict[str, int]], what: str) -> None:
        """Measured ``Traffic.as_dict()`` equals the formula per axis and kind, up to one
        byte of rounding per collective."""
        want = {a: {k: v for k, v in kinds.items() if round(v)} for a, kinds in self.bytes.items()}
        want = {a: kinds for a, kinds in want.items() if kinds}
        got = {a: {k: v for k, v in kinds.items() if v} for a, kinds in measured.items()}
        got = {a: kinds for a, kinds in got.items() if kinds}
        bad = set(got) != set(want) or any(set(got[a]) != set(want[a]) for a in want)
        if not bad:
            bad = any(
                abs(got[a][k] - want[a][k]) > max(1, self.calls[a][k])
                for a in want
                for k in want[a]
            )
        if bad:
            rounded = {a: {k: round(v, 1) for k, v in kinds.items()} for a, kinds in want.items()}
            raise AssertionError(f"{what}: measured {got}, formula {rounded}")


def plexus_bytes(
    shape: dict[str, int],
    coords: dict[str, int],
    n: int,
    dims: list[int],
    num_ops: int,
    es: int,
    input_grad: bool,
    bias: bool,
    chunks: int = 1,
) -> tuple[Bytes, Bytes]:
    """Forward and backward bytes of the 3D (Plexus) model on the rank at ``coords``.

    Layer ℓ with roles (a, b, c) holds Â rows chunk c × columns chunk a, H rows chunk a ×
    features chunk b, W features chunk b × outputs chunk a (flattened, split over c):

    forward:  [ℓ = 0] all-gather H over c; all-reduce ÂH over a (``chunks`` row pieces);
              all-gather W over c; all-reduce (ÂH)W over b
    backward: all-gather W over c; all-reduce the gradient of ÂH over a (ℓ > 0, or ℓ = 0
              with ``input_grad``: it only serves H's gradient); reduce-scatter the gradient
              of W over c; the gradient of H: reduce-scatter over c (ℓ = 0, only with
              ``input_grad``) or all-reduce over c (ℓ > 0); bias: all-reduce over c
    """
    fwd, bwd = Bytes(), Bytes()
    for layer, (d_in, d_out) in enumerate(zip(dims, dims[1:], strict=False)):
        a, b, c = ROLES[layer % 3]
        pa, pb, pc = shape[a], shape[b], shape[c]
        rows = chunk(n, pc, coords[c])
        cols = chunk(n, pa, coords[a])
        fin = chunk(d_in, pb, coords[b])
        fout = chunk(d_out, pa, coords[a])
        h_padded = pc * biggest(cols, pc) * fin * es
        w_padded = pc * biggest(num_ops * fin * fout, pc) * es
        if layer == 0:
            fwd.add(c, "all_gather", pc, h_padded)
        for k in range(chunks):
            piece = chunk(rows, chunks, k)
            if piece:
                fwd.add(a, "all_reduce", pa, piece * num_ops * fin * es)
        fwd.add(c, "all_gather", pc, w_padded)
        fwd.add(b, "all_reduce", pb, rows * fout * es)
        bwd.add(c, "all_gather", pc, w_padded)
        if layer > 0 or input_grad:
            bwd.add(a, "all_reduce", pa, rows * num_ops * fin * es)
        bwd.add(c, "reduce_scatter", pc, w_padded)
        if layer > 0:
            bwd.add(c, "all_reduce", pc, cols * fin * es)
        elif input_grad:
            bwd.add(c, "reduce_scatter", pc, h_padded)
        if bias:
            bwd.add(c, "all_reduce", pc, fout * es)
    return fwd, bwd


def summa_bytes(
    shape: dict[str, int],
    coords: dict[str, int],
    n: int,
    dims: list[int],
    num_ops: int,
    es: int,
    input_grad: bool,
    bias: bool,
    stage_nnz: list[list[list[int]]],
) -> tuple[Bytes, Bytes]:
    """Forward and backward bytes of CAGNET's 2D (SUMMA) model on the rank at ``coords``.

    R × C = x × y; rank (i, j) holds Â rows chunk i × columns chunk j and H rows chunk i ×
    features chunk j; W is replicated. ``stage_nnz[ℓ][op][j′]`` is the nonzero count of block
    (i, j′) of operator ``op`` in layer ℓ, broadcast over y from column j′ as (indptr int64,
    column ids int32, values):

    forward:  all-gather H's column block over x; the row of Â streamed over y; all-gather
              each operator's aggregate over y (features)
    backward: W's columns: all-gather over y, then all-reduce over x; bias likewise; with a
              gradient for H: reduce-scatter over y, the row of Â streamed again,
              reduce-scatter over x
    """
    r, c = shape["x"], shape["y"]
    rows = chunk(n, r, coords["x"])
    fwd, bwd = Bytes(), Bytes()
    for layer, (d_in, d_out) in enumerate(zip(dims, dims[1:], strict=False)):
        fin = chunk(d_in, c, coords["y"])
        h_col = r * biggest(n, r) * fin * es
        agg = c * biggest(d_in, c) * rows * es
        streams = []
        for per_op in stage_nnz[layer]:
            for nnz in per_op:
                streams += [(rows + 1) * INT64, nnz * INT32, nnz * es]
        fwd.add("x", "all_gather", r, h_col)
        for v in streams:
            fwd.add("y", "broadcast", c, v)
        for _ in range(num_ops):
            fwd.add("y", "all_gather", c, agg)
        bwd.add("y", "all_gather", c, c * biggest(d_out, c) * num_ops * d_in * es)
        bwd.add("x", "all_reduce", r, num_ops * d_in * d_out * es)
        if bias:
            bwd.add("y", "all_gather", c, c * biggest(d_out, c) * es)
            bwd.add("x", "all_reduce", r, d_out * es)
        if layer > 0 or input_grad:
            for _ in range(num_ops):
                bwd.add("y", "reduce_scatter", c, agg)
            for v in streams:
                bwd.add("y", "broadcast", c, v)
            bwd.add("x", "reduce_scatter", r, h_col)
    return fwd, bwd


def rows1d_bytes(
    p: int, n: int, dims: list[int], num_ops: int, es: int, input_grad: bool, bias: bool
) -> tuple[Bytes, Bytes]:
    """Forward and backward bytes of CAGNET's 1D model over the ``tensor`` axis (p ranks).

    forward:  all-gather H (rows) per layer
    backward: reduce-scatter H's gradient (not for raw input features without ``input_grad``);
              all-reduce of the replicated weight's (and bias's) gradient
    """
    fwd, bwd = Bytes(), Bytes()
    for layer, (d_in, d_out) in enumerate(zip(dims, dims[1:], strict=False)):
        h = p * biggest(n, p) * d_in * es
        fwd.add("tensor", "all_gather", p, h)
        if layer > 0 or input_grad:
            bwd.add("tensor", "reduce_scatter", p, h)
        bwd.add("tensor", "all_reduce", p, num_ops * d_in * d_out * es)
        if bias:
            bwd.add("tensor", "all_reduce", p, d_out * es)
    return fwd, bwd


def gat3d_bytes(
    shape: dict[str, int],
    coords: dict[str, int],
    n: int,
    dims: list[int],
    heads: list[int],
    es: int,
    bias: bool,
) -> tuple[Bytes, Bytes]:
    """Forward and backward bytes of the 3D GAT model on the rank at ``coords``; layer ℓ has
    ``heads[ℓ]`` heads of F features (concatenated: ``dims[ℓ+1] = heads·F``; the last layer
    averages them: F = ``dims[-1]``).

    Layer ℓ with roles (a, b, c) holds Â rows chunk c × columns chunk a, H rows chunk a ×
    features chunk b and the weight's rows chunk b (all heads·F columns):

    forward:  [ℓ = 0] all-gather H over c; all-reduce Z = H·W (columns × heads·F) over b;
              all-reduce over a of the rows' destination scores, the softmax row maxima and
              row sums (rows × heads each); reduce-scatter over a of the output (rows × the
              output features padded to a multiple of the outer size)
    backward: all-gather of the output's gradient over a; all-reduce over a of the row sums'
              and the destination scores' gradients; all-reduce of Z's gradient over c; the
              two attention vectors' gradients (heads·F) all-reduced over c and over a; the
              weight's gradient (its rows × heads·F) over a; bias: all-reduce over c
    """
    fwd, bwd = Bytes(), Bytes()
    last = len(dims) - 2
    for layer, (d_in, d_out) in enumerate(zip(dims, dims[1:], strict=False)):
        a, b, c = ROLES[layer % 3]
        pa, pb, pc = shape[a], shape[b], shape[c]
        k = heads[layer]
        width = d_out * k if layer == last else d_out  # heads·F
        rows = chunk(n, pc, coords[c])
        cols = chunk(n, pa, coords[a])
        fin = chunk(d_in, pb, coords[b])
        fout = chunk(d_out, pa, coords[a])
        out_padded = pa * biggest(d_out, pa) * rows * es
        if layer == 0:
            fwd.add(c, "all_gather", pc, pc * biggest(cols, pc) * fin * es)
        fwd.add(b, "all_reduce", pb, cols * width * es)
        for _ in range(3):
            fwd.add(a, "all_reduce", pa, rows * k * es)
        fwd.add(a, "reduce_scatter", pa, out_padded)
        bwd.add(a, "all_gather", pa, out_padded)
        for _ in range(2):
            bwd.add(a, "all_reduce", pa, rows * k * es)
        bwd.add(c, "all_reduce", pc, cols * width * es)
        for _ in range(2):
            bwd.add(c, "all_reduce", pc, width * es)
            bwd.add(a, "all_reduce", pa, width * es)
        bwd.add(a, "all_reduce", pa, fin * width * es)
        if bias:
            bwd.add(c, "all_reduce", pc, fout * es)
    return fwd, bwd


def gat1d_bytes(
    p: int, n: int, dims: list[int], heads: list[int], es: int, bias: bool
) -> tuple[Bytes, Bytes]:
    """Forward and backward bytes of the 1D GAT model over the ``tensor`` axis (p ranks).

    forward:  all-gather Z = H·W (rows × heads·F) per layer
    backward: reduce-scatter Z's gradient; all-reduce of the two attention vectors' (heads·F
              each), the weight's (d_in × heads·F) and the bias's gradients
    """
    fwd, bwd = Bytes(), Bytes()
    last = len(dims) - 2
    for layer, (d_in, d_out) in enumerate(zip(dims, dims[1:], strict=False)):
        width = d_out * heads[layer] if layer == last else d_out
        z = p * biggest(n, p) * width * es
        fwd.add("tensor", "all_gather", p, z)
        bwd.add("tensor", "reduce_scatter", p, z)
        for numel in (width, width, d_in * width):
            bwd.add("tensor", "all_reduce", p, numel * es)
        if bias:
            bwd.add("tensor", "all_reduce", p, d_out * es)
    return fwd, bwd


def gat2d_bytes(
    shape: dict[str, int],
    coords: dict[str, int],
    n: int,
    dims: list[int],
    heads: list[int],
    es: int,
    bias: bool,
) -> tuple[Bytes, Bytes]:
    """Forward and backward bytes of the 2D GAT model on the rank at ``coords`` (R × C =
    x × y; rank (i, j) holds Â rows chunk i × columns chunk j, H rows chunk i × features
    chunk j and the weight's rows chunk j; heads as in :func:`gat3d_bytes`):

    forward:  all-reduce Z (rows i × heads·F) over y; all-gather it over x (every node,
              padded); all-reduce the rows' destination scores, the softmax row maxima and
              sums (rows × heads each) over y; reduce-scatter the output over y (rows ×
              output features padded)
    backward: all-gather the output's gradient over y; all-reduce the row sums' and the
              destination scores' gradients over y; reduce-scatter Z's gradient over x,
              then all-reduce it over y; the two attention vectors' gradients all-reduced
              over y and over x; the weight's (its rows × heads·F) and the bias's (its
              columns) over x
    """
    r, c = shape["x"], shape["y"]
    rows = chunk(n, r, coords["x"])
    fwd, bwd = Bytes(), Bytes()
    last = len(dims) - 2
    for layer, (d_in, d_out) in enumerate(zip(dims, dims[1:], strict=False)):
        k = heads[layer]
        width = d_out * k if layer == last else d_out
        fin = chunk(d_in, c, coords["y"])
        fout = chunk(d_out, c, coords["y"])
        out_padded = c * biggest(d_out, c) * rows * es
        z_all = r * biggest(n, r) * width * es
        fwd.add("y", "all_reduce", c, rows * width * es)
        fwd.add("x", "all_gather", r, z_all)
        for _ in range(3):
            fwd.add("y", "all_reduce", c, rows * k * es)
        fwd.add("y", "reduce_scatter", c, out_padded)
        bwd.add("y", "all_gather", c, out_padded)
        for _ in range(2):
            bwd.add("y", "all_reduce", c, rows * k * es)
        bwd.add("x", "reduce_scatter", r, z_all)
        bwd.add("y", "all_reduce", c, rows * width * es)
        for _ in range(2):
            bwd.add("y", "all_reduce", c, width * es)
            bwd.add("x", "all_reduce", r, width * es)
        bwd.add("x", "all_reduce", r, fin * width * es)
        if bias:
            bwd.add("x", "all_reduce", r, fout * es)
    return fwd, bwd


def gin_bytes(
    algorithm: str,
    shape: dict[str, int],
    coords: dict[str, int],
    n: int,
    dims: list[int],
    es: int,
    bias: bool,
    batch_norm: bool = True,
) -> tuple[Bytes, Bytes]:
    """Forward and backward bytes of the GIN model (MLP width = the layer's output width) on
    the rank at ``coords`` of ``algorithm`` ("3d"; "2d" on x × y; "1d" over ``tensor``).

    Z = H·W₁ as for GAT (:func:`gat3d_bytes`, :func:`gat2d_bytes`, :func:`gat1d_bytes`:
    3D all-reduce over b, gradient over c, W₁'s over a; 2D all-reduce over y then all-gather
    over x; 1D all-gather), then the sum over the block (neighbours and the (1 + ε) self
    term) and the MLP's second product are each reduce-scattered over the axis splitting a
    row's columns (3D a, 2D y; none in 1D) into this rank's output features (padded), their
    gradients all-gathered back; ε's gradient (one element) is all-reduced over that axis
    and the rows' axis (3D c, 2D x, 1D the only one), as are the second weight's (output
    features chunk × width) and both biases' (the chunk) over the rows' axis. With
    ``batch_norm`` (whose shift replaces the first bias) the BatchNorm's mean and variance of
    the chunk's features are all-reduced over the rows' axis forward, their gradients
    backward, and so are the gradients of its scale and shift.
    """
    fwd, bwd = Bytes(), Bytes()
    for layer, (d_in, d_out) in enumerate(zip(dims, dims[1:], strict=False)):
        if algorithm == "3d":
            a, b, c = ROLES[layer % 3]
            pa, pb, pc = shape[a], shape[b], shape[c]
            part, rows_ax, pp, pr = a, c, pa, pc
            rows = chunk(n, pc, coords[c])
            cols = chunk(n, pa, coords[a])
            fin = chunk(d_in, pb, coords[b])
            fout = chunk(d_out, pa, coords[a])
            if layer == 0:
                fwd.add(c, "all_gather", pc, pc * biggest(cols, pc) * fin * es)
            fwd.add(b, "all_reduce", pb, cols * d_out * es)
            bwd.add(c, "all_reduce", pc, cols * d_out * es)
            bwd.add(a, "all_reduce", pa, fin * d_out * es)
        elif algorithm == "2d":
            r, c = shape["x"], shape["y"]
            part, rows_ax, pp, pr = "y", "x", c, r
            rows = chunk(n, r, coords["x"])
            fin = chunk(d_in, c, coords["y"])
            fout = chunk(d_out, c, coords["y"])
            z_all = r * biggest(n, r) * d_out * es
            fwd.add("y", "all_reduce", c, rows * d_out * es)
            fwd.add("x", "all_gather", r, z_all)
            bwd.add("x", "reduce_scatter", r, z_all)
            bwd.add("y", "all_reduce", c, rows * d_out * es)
            bwd.add("x", "all_reduce", r, fin * d_out * es)
        else:
            p = shape["x"] * shape["y"] * shape["z"]
            part, rows_ax, pp, pr = None, "tensor", 1, p
            rows, fout = 0, d_out
            z = p * biggest(n, p) * d_out * es
            fwd.add("tensor", "all_gather", p, z)
            bwd.add("tensor", "reduce_scatter", p, z)
            bwd.add("tensor", "all_reduce", p, d_in * d_out * es)
        if part is not None:
            out_padded = pp * biggest(d_out, pp) * rows * es
            for _ in range(2):
                fwd.add(part, "reduce_scatter", pp, out_padded)
                bwd.add(part, "all_gather", pp, out_padded)
            bwd.add(part, "all_reduce", pp, es)
        bwd.add(rows_ax, "all_reduce", pr, es)
        bwd.add(rows_ax, "all_reduce", pr, fout * d_out * es)
        # the second bias, and the first where no BatchNorm shift takes its place
        for _ in range(int(bias) * (1 if batch_norm else 2)):
            bwd.add(rows_ax, "all_reduce", pr, fout * es)
        if batch_norm:
            for _ in range(2):  # the mean and the variance; the scale and the shift
                fwd.add(rows_ax, "all_reduce", pr, fout * es)
                bwd.add(rows_ax, "all_reduce", pr, fout * es)
                bwd.add(rows_ax, "all_reduce", pr, fout * es)
    return fwd, bwd


def rgcn3d_bytes(
    shape: dict[str, int],
    coords: dict[str, int],
    n: int,
    dims: list[int],
    relations: int,
    es: int,
    input_grad: bool,
    bias: bool,
    chunks: int = 1,
    bases: int = 0,
) -> tuple[Bytes, Bytes]:
    """Forward and backward bytes of the 3D R-GCN model of ``relations`` relations on the rank
    at ``coords``, written per relation.

    With ``bases`` B > 0 the weight blocks are the B bases and the root (the W gathers and the
    dW reduce-scatter carry B + 1 blocks, not R + 1), and backward adds an all-reduce of the
    coefficients' gradient, R·B values, over all x·y·z ranks (``"tensor"``).

    Layer ℓ with roles (a, b, c) aggregates every relation's ``Â_r H`` and the root's ``H``
    side by side, R + 1 pieces of the rank's rows × its ``fin`` features, and multiplies
    them by the stacked weight ``[W_1; …; W_R; W_root]`` (R + 1 blocks of fin × fout,
    flattened, split over c):

    forward:  [ℓ = 0] all-gather H over c; all-reduce over a of the aggregate, each relation's
              rows·fin and the root's rows·fin in one buffer (``chunks`` row pieces); all-gather
              of the weight blocks over c; all-reduce of the output rows·fout over b
    backward: the weight blocks gathered again over c; all-reduce over a of the aggregate's
              gradient (per relation and root; ℓ > 0, or ℓ = 0 with ``input_grad``: only H's
              gradient reads it); reduce-scatter of the weight blocks' gradient over c; H's
              gradient: reduce-scatter over c (ℓ = 0, only with ``input_grad``) or all-reduce
              over c (ℓ > 0); bias: all-reduce over c
    """
    fwd, bwd = Bytes(), Bytes()
    for layer, (d_in, d_out) in enumerate(zip(dims, dims[1:], strict=False)):
        a, b, c = ROLES[layer % 3]
        pa, pb, pc = shape[a], shape[b], shape[c]
        rows = chunk(n, pc, coords[c])
        cols = chunk(n, pa, coords[a])
        fin = chunk(d_in, pb, coords[b])
        fout = chunk(d_out, pa, coords[a])
        per_row = sum(fin for _ in range(relations)) + fin  # relations' aggregates, root's H
        stored = bases if bases else relations  # V_1..V_B or W_1..W_R
        weights = sum(fin * fout for _ in range(stored)) + fin * fout  # and W_root
        h_padded = pc * biggest(cols, pc) * fin * es
        w_padded = pc * biggest(weights, pc) * es
        if layer == 0:
            fwd.add(c, "all_gather", pc, h_padded)
        for k in range(chunks):
            if chunk(rows, chunks, k):
                fwd.add(a, "all_reduce", pa, chunk(rows, chunks, k) * per_row * es)
        fwd.add(c, "all_gather", pc, w_padded)
        fwd.add(b, "all_reduce", pb, rows * fout * es)
        bwd.add(c, "all_gather", pc, w_padded)
        if layer > 0 or input_grad:
            bwd.add(a, "all_reduce", pa, rows * per_row * es)
        if bases and pa * pb * pc > 1:
            bwd.add("tensor", "all_reduce", pa * pb * pc, relations * bases * es)
        bwd.add(c, "reduce_scatter", pc, w_padded)
        if layer > 0:
            bwd.add(c, "all_reduce", pc, cols * fin * es)
        elif input_grad:
            bwd.add(c, "reduce_scatter", pc, h_padded)
        if bias:
            bwd.add(c, "all_reduce", pc, fout * es)
    return fwd, bwd
