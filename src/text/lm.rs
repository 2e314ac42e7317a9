//! Language-model batches from a token stream: row `r` holds `seq` consecutive tokens and, at
//! each position, the token that follows it in the stream as the target.

use crate::error::{Result, data_error};
use crate::model::{HostBatch, IGNORE_INDEX};

/// One batch of windows of `stream`, starting at `starts`: `tokens[r][t] = stream[s + t]`
/// and `targets[r][t] = stream[s + t + 1]` for `s = starts[r]`. Where the stream ends first,
/// tokens are `pad_id` and targets [`IGNORE_INDEX`]. No attention mask is set: padding only
/// ever follows real tokens, and causal attention never lets a position see later ones.
/// `sample_offset` is the global index of the first row (see [`HostBatch::sample_offset`]).
///
/// Errors ([`Error::Data`](crate::Error::Data)): no starts, `seq` 0, or a start with no next
/// token (`start + 1 >= stream.len()`), whose row would have no target.
pub fn stream_batch(
    stream: &[u32],
    starts: &[usize],
    seq: usize,
    pad_id: u32,
    sample_offset: u64,
) -> Result<HostBatch> {
    if starts.is_empty() {
        return Err(data_error("lm batch", "has no window starts; expected at least one"));
    }
    if seq == 0 {
        return Err(data_error("lm batch", "sequence length is 0"));
    }
    let n = stream.len();
    let mut tokens = Vec::with_capacity(starts.len() * seq);
    let mut targets = Vec::with_capacity(starts.len() * seq);
    for &s in starts {
        if s.saturating_add(1) >= n {
            return Err(data_error(
                "lm batch",
                format!(
                    "window start {s} leaves no next token in a stream of {n} tokens; starts must be < {}",
                    n.saturating_sub(1)
                ),
            ));
        }
        tokens.extend((s..s + seq).map(|i| stream.get(i).copied().unwrap_or(pad_id)));
        targets.extend((s + 1..s + 1 + seq).map(|i| stream.get(i).copied().unwrap_or(IGNORE_INDEX)));
    }
    Ok(HostBatch { batch: starts.len(), seq, tokens: Some(tokens), targets, sample_offset, ..HostBatch::default() })
}

/// The whole stream as consecutive, non-overlapping windows of `seq` tokens, `batch` windows
/// per [`HostBatch`] (the last batch may hold fewer). Every token that has a successor is
/// predicted exactly once; the last window is padded as in [`stream_batch`]. Window `w` gets
/// `sample_offset = w`, so dropout masks do not depend on how the windows are batched.
///
/// Errors ([`Error::Data`](crate::Error::Data)): `seq` or `batch` 0, or a stream shorter than
/// two tokens.
pub fn stream_batches(stream: &[u32], seq: usize, batch: usize, pad_id: u32) -> Result<Vec<HostBatch>> {
    if seq == 0 || batch == 0 {
        return Err(data_error("lm batches", format!("seq = {seq} and batch = {batch}; both must be at least 1")));
    }
    if stream.len() < 2 {
        return Err(data_error("lm batches", format!("stream has {} tokens; need at least 2", stream.len())));
    }
    // Positions 0..len-1 have a next token; windows of `seq` cover them.
    let starts: Vec<usize> = (0..stream.len() - 1).step_by(seq).collect();
    starts
        .chunks(batch)
        .enumerate()
        .map(|(i, chunk)| stream_batch(stream, chunk, seq, pad_id, (i * batch) as u64))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    const I: u32 = IGNORE_INDEX;

    #[test]
    fn windows_predict_the_next_token() {
        let stream: Vec<u32> = (10..20).collect();
        let b = stream_batch(&stream, &[0, 3, 7], 4, 99, 5).unwrap();
        assert_eq!((b.batch, b.seq, b.sample_offset, b.position_offset), (3, 4, 5, 0));
        #[rustfmt::skip]
        assert_eq!(b.tokens.as_deref().unwrap(), [
            10, 11, 12, 13,
            13, 14, 15, 16,
            17, 18, 19, 99,
        ]);
        #[rustfmt::skip]
        assert_eq!(b.targets, [
            11, 12, 13, 14,
            14, 15, 16, 17,
            18, 19, I, I,
        ]);
        assert!(b.attention_mask.is_none() && b.token_types.is_none());
    }

    #[test]
    fn batches_cover_every_prediction_once() {
        let stream: Vec<u32> = (0..11).collect();
        let batches = stream_batches(&stream, 3, 2, 0).unwrap();
        // 10 positions have a next token: windows at 0, 3, 6, 9 → batches of 2 and 2.
        assert_eq!(batches.len(), 2);
        assert_eq!(batches.iter().map(|b| (b.batch, b.sample_offset)).collect::<Vec<_>>(), [(2, 0), (2, 2)]);
        let predicted: Vec<u32> = batches.iter().flat_map(|b| b.targets.iter().copied()).filter(|&t| t != I).collect();
        assert_eq!(predicted, (1..11).collect::<Vec<u32>>());
        assert_eq!(batches[1].tokens.as_deref().unwrap()[3..], [9, 10, 0]);
        assert_eq!(batches[1].targets[3..], [10, I, I]);
        // A window that ends exactly at the stream's end still predicts across its last token.
        let exact = stream_batches(&stream[..7], 3, 8, 0).unwrap();
        assert_eq!(exact[0].targets, [1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn bad_arguments_are_data_errors() {
        let stream = [1, 2, 3];
        let cases = [
            stream_batch(&stream, &[], 2, 0, 0),
            stream_batch(&stream, &[0], 0, 0, 0),
            stream_batch(&stream, &[2], 2, 0, 0),
            stream_batch(&stream, &[usize::MAX], 2, 0, 0),
            stream_batches(&stream, 0, 1, 0).map(|_| HostBatch::default()),
            stream_batches(&stream, 1, 0, 0).map(|_| HostBatch::default()),
            stream_batches(&stream[..1], 1, 1, 0).map(|_| HostBatch::default()),
        ];
        for (i, case) in cases.into_iter().enumerate() {
            assert!(matches!(case, Err(Error::Data { .. })), "case {i}: {case:?}");
        }
    }
}
