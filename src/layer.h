/* layer.h — what the library itself asks of a layer beyond fmha.h
 * (layer.c): a call that is one piece of a larger attention problem, as
 * sequence parallelism (src/sp/) makes them. */
#ifndef FMHA_LAYER_H
#define FMHA_LAYER_H

#include "fmha.h"

/* A piece of a larger problem: its own mask (causal and windows replacing
 * the layer's, which the piece's rows and keys need where they sit in the
 * whole), and its place in the whole for the dropout stream: the piece's row
 * i, key j and head h draw at (row0 + i, col0 + j, head0 + h) of a problem of
 * `heads` query heads. */
typedef struct fmha_piece {
    int causal;
    int64_t window_left, window_right;
    int64_t row0, col0, head0, heads;
} fmha_piece;

/* fmha_layer_forward for one piece. */
fmha_status fmha_layer_forward_piece(fmha_layer *layer, const fmha_forward_args *args,
                                     const fmha_piece *piece);

#endif /* FMHA_LAYER_H */
