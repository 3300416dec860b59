"""A convolution's products, in one of two strategies that the model's kernels (mpisgd.kernels) decide:

- :class:`ColumnProducts` (the fast kernels): im2col copies the input's windows into columns, a few output
  rows at a time (Conv2d's CHUNK_BYTES, in a core's L2), one batched product per chunk; the input
  gradient by kernel offset takes one product per offset.
- :class:`SampleProducts` (the portable kernels): the input first becomes integers with one power of two
  per sample (mpisgd.portable.samples), whose columns need no splitting of their own; chunks are larger
  (the portable products pay a fixed cost each), the weight gradient multiplies every slice's columns in
  one product, and the input gradient takes one product per row of kernel offsets, dy prepared once.

Conv2d (mpisgd.nn.layers) keeps the layer's state and its column helpers (window views, row chunks,
im2col into its buffers) and asks :func:`products_for` for the strategy of its kernels at each call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from mpisgd.nn.module import Array

if TYPE_CHECKING:
    from mpisgd.kernels import PortableKernels
    from mpisgd.nn.layers import Conv2d


class ColumnProducts:
    """Columns from the input itself; what the layers did before the kernels could be chosen."""

    columns_nbytes: int | None = None  # Conv2d's own chunks (CHUNK_BYTES)

    def correlate(self, conv: Conv2d, padded: Array, W: Array, out: Array, state: Any, by_window: bool) -> Any:
        """out (c', Ho, Wo, N) = ``padded`` (c, Hp, Wp, N) correlated with W (c', c k k); per position
        (c', ckk) @ (ckk, N), written straight into out's rows. Keeps no state (returns None)."""
        kernels = conv.ctx.kernels
        c_out, ho, wo, n = out.shape
        windows = conv._windows(padded, ho, wo)
        W = kernels.left(W)  # one W for every chunk
        for r0, r1 in conv._row_chunks(ho, wo, n, padded.itemsize, padded.shape[0], self.columns_nbytes):
            cols = conv._im2col(windows, r0, r1)
            out_rows = out[:, r0:r1].reshape(c_out, (r1 - r0) * wo, n)
            kernels.matmul(W, cols.transpose(1, 0, 2), out=out_rows.transpose(1, 0, 2))
        return None

    def weight_grad_chunks(self, conv: Conv2d, dy: Array, state: Any) -> tuple[Array, Any]:
        """dW per chunk of output rows, (chunks, c k k, c'): cols (ckk, M) @ dy^T (M, c'), M the chunk's
        positions x N, with the columns made again from the kept padded input."""
        ops = conv.ctx.kernels
        _, ho, wo, n = dy.shape
        ckk = conv.c_in * conv.k * conv.k
        windows = conv._windows(conv._xpad, ho, wo)
        chunks = conv._row_chunks(ho, wo, n, windows.itemsize, None, self.columns_nbytes)
        dW_chunks = conv._buf("dW_chunks", (len(chunks), ckk, conv.c_out), dy)
        for g, (r0, r1) in enumerate(chunks):
            cols = conv._im2col(windows, r0, r1)
            ops.matmul(cols.reshape(ckk, -1), dy[:, r0:r1].reshape(conv.c_out, -1).T, out=dW_chunks[g])
        return dW_chunks, None

    def add_back(self, conv: Conv2d, dy: Array, W_t: Array, targets: Array) -> None:
        """Onto ``targets`` (the padded dx's window view), W[:, :, i, j]^T dy for each kernel offset (i, j),
        one product per offset (``W_t`` (k, k, c, c'))."""
        ops = conv.ctx.kernels
        c = conv.c_in
        _, ho, wo, n = dy.shape
        dy_pos = ops.right(dy.reshape(conv.c_out, ho * wo, n).transpose(1, 0, 2))  # (positions, c_out, N)
        back = conv._buf("back", (c, ho, wo, n), dy)
        for i in range(conv.k):
            for j in range(conv.k):
                ops.matmul(W_t[i, j], dy_pos, out=back.reshape(c, ho * wo, n).transpose(1, 0, 2))
                targets[:, i, j] += back


class SampleProducts:
    """The padded input as integers with one power of two per sample (the kernels' ``samples``), the
    columns made from them."""

    columns_nbytes: int | None = 4 * 2**20  # fewer, larger products: each pays a fixed cost

    def correlate(self, conv: Conv2d, padded: Array, W: Array, out: Array, state: Any, by_window: bool) -> Any:
        """:meth:`ColumnProducts.correlate` from prepared samples (``state``: the last call's, whose arrays
        are reused; ``by_window``: each sample scaled by its largest window, one slice, else by its largest
        element, two); one product (c', ckk) @ (ckk, positions x N) per chunk, the same bits as per position
        (exact). Returns the samples."""
        kernels = cast("PortableKernels", conv.ctx.kernels)  # products_for chose this strategy by them
        c_out, ho, wo, n = out.shape
        samples = kernels.samples(padded, W.shape[1], state, (conv.k, conv.stride, ho, wo) if by_window else None)
        windows = [conv._windows(q, ho, wo) for q, _ in samples.slices]
        W = kernels.left(W)
        for r0, r1 in conv._row_chunks(ho, wo, n, windows[0].itemsize, windows[0].shape[0], self.columns_nbytes):
            cols = [conv._im2col(w, r0, r1, f"cols{i}", samples.padded_rows()) for i, w in enumerate(windows)]
            kernels.matmul(W, samples.columns(cols), out=out[:, r0:r1].reshape(c_out, -1))
        return samples

    def weight_grad_chunks(self, conv: Conv2d, dy: Array, state: Any) -> tuple[Array, Any]:
        """As :meth:`ColumnProducts.weight_grad_chunks`, from the input's integers: the scale per sample
        moved onto dy, every slice's columns stacked into one product (Samples.weight_grad), the slices
        added in float64 (Samples.combine). Returns the chunks and the samples."""
        ops = cast("PortableKernels", conv.ctx.kernels)
        _, ho, wo, n = dy.shape
        ckk = conv.c_in * conv.k * conv.k
        samples = ops.samples(conv._xpad, ckk, state)
        windows = [conv._windows(q, ho, wo) for q, _ in samples.slices]
        chunks = conv._row_chunks(ho, wo, n, windows[0].itemsize, None, self.columns_nbytes)
        dW_chunks = conv._buf("dW_chunks", (len(chunks), ckk, conv.c_out), dy)
        for g, (r0, r1) in enumerate(chunks):
            cols = self._stacked(conv, windows, r0, r1, samples.padded_terms((r1 - r0) * wo * n))
            cols_q, dy_q = samples.weight_grad(cols, dy[:, r0:r1])
            stacked = conv._buf("dW_stacked", (cols.shape[0], conv.c_out), dy, dtype="float64")
            samples.combine(ops.matmul(cols_q, dy_q, out=stacked), out=dW_chunks[g])
        return dW_chunks, samples

    def add_back(self, conv: Conv2d, dy: Array, W_t: Array, targets: Array) -> None:
        """As :meth:`ColumnProducts.add_back`, a row of offsets per product: W_t[i] as (k c, c') @ dy as
        (c', positions x N), dy split once for the k products."""
        ops = conv.ctx.kernels
        c, k = conv.c_in, conv.k
        _, ho, wo, n = dy.shape
        W_rows = ops.left(W_t.reshape(k, k * c, conv.c_out))
        dy_cols = ops.right(dy.reshape(conv.c_out, -1))
        back = conv._buf("back_row", (k, c, ho, wo, n), dy)
        for i in range(k):
            ops.matmul(W_rows[i], dy_cols, out=back.reshape(k * c, -1))
            for j in range(k):
                targets[:, i, j] += back[j]

    @staticmethod
    def _stacked(conv: Conv2d, windows: list[Array], r0: int, r1: int, width: int) -> Array:
        """The columns of each window view as (c k k, width), stacked: (len(windows) c k k, width), the
        (r1 - r0) Wo N terms of each row first, the rest zero."""
        c, k, _, _, wo, n = windows[0].shape
        m, ckk = (r1 - r0) * wo * n, c * k * k
        cols = conv._buf("cols_stacked", (len(windows) * ckk, width), windows[0])
        cols[:, m:] = 0  # the padding (a chunk of other m may share this width)
        for i, w in enumerate(windows):
            cols[i * ckk:(i + 1) * ckk, :m].reshape(c, k, k, r1 - r0, wo, n)[...] = w[:, :, :, r0:r1]
        return cols


PRODUCTS: dict[str, ColumnProducts | SampleProducts] = {"fast": ColumnProducts(), "portable": SampleProducts()}


def products_for(kernels: Any) -> ColumnProducts | SampleProducts:
    """The strategy for a model's kernels (``kernels.name``: fast or portable)."""
    return PRODUCTS[kernels.name]
