//! `text_batch`: labelled texts to a padded [`HostBatch`] for a BERT sequence classifier;
//! `encoded_batch`: the same from texts tokenised beforehand.

use super::tokenizer::{Encoded, TextInput, TextTokenizer};
use crate::error::{Result, data_error};
use crate::model::HostBatch;

/// One labelled sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TextItem<'a> {
    /// The data set's id for the sample, carried through to [`HostBatch::sample_ids`] (e.g.
    /// to key cached activations of frozen layers).
    pub id: u64,
    /// The text, or text pair.
    pub input: TextInput<'a>,
    /// Class index.
    pub label: u32,
}

/// A classifier batch with what the [`HostBatch`] itself does not carry.
#[derive(Clone, Debug, PartialEq)]
pub struct TextBatch {
    /// Tokens, token types, attention mask and labels, padded to the longest sample.
    pub host: HostBatch,
    /// Real (unpadded) tokens of each row.
    pub lengths: Vec<usize>,
    /// Per row: whether it lost tokens to the tokenizer's `max_len`.
    pub truncated: Vec<bool>,
}

/// A labelled sample tokenised beforehand ([`TextTokenizer::encode_batch`]): a training run
/// tokenises its samples once and pads them into batches every epoch ([`encoded_batch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncodedItem<'a> {
    /// As [`TextItem::id`].
    pub id: u64,
    /// Its ids and type ids.
    pub encoded: &'a Encoded,
    /// Class index.
    pub label: u32,
}

/// Tokenises `items` and pads them to the longest one in the batch (not to `max_len`, so a
/// batch of short texts stays short). Padding positions get the tokenizer's pad id, its pad
/// type id and attention mask 0; `targets` are the labels; `sample_offset` is the global
/// index of the first item (it places the batch's dropout masks, see
/// [`HostBatch::sample_offset`]).
///
/// Errors: an empty `items` ([`Error::Data`](crate::Error::Data)), or a tokenizer failure.
pub fn text_batch(tokenizer: &TextTokenizer, items: &[TextItem<'_>], sample_offset: u64) -> Result<TextBatch> {
    let inputs: Vec<TextInput<'_>> = items.iter().map(|item| item.input).collect();
    let encodings = tokenizer.encode_batch(&inputs)?;
    let encoded: Vec<EncodedItem<'_>> = items
        .iter()
        .zip(&encodings)
        .map(|(item, encoded)| EncodedItem { id: item.id, encoded, label: item.label })
        .collect();
    encoded_batch(tokenizer, &encoded, sample_offset)
}

/// [`text_batch`] of samples `tokenizer` has already encoded: the same batch, padded from
/// their ids without tokenising again.
///
/// Errors: an empty `items`, items that are all empty, or an item with another number of
/// token types than ids ([`Error::Data`](crate::Error::Data)).
pub fn encoded_batch(tokenizer: &TextTokenizer, items: &[EncodedItem<'_>], sample_offset: u64) -> Result<TextBatch> {
    if items.is_empty() {
        return Err(data_error("text batch", "is empty; expected at least one item"));
    }
    if let Some(item) = items.iter().find(|item| item.encoded.type_ids.len() != item.encoded.ids.len()) {
        let (ids, types) = (item.encoded.ids.len(), item.encoded.type_ids.len());
        return Err(data_error(
            "text batch",
            format!("item {} has {ids} token ids and {types} token types; expected one type per id", item.id),
        ));
    }
    let batch = items.len();
    let seq = items.iter().map(|item| item.encoded.ids.len()).max().unwrap_or(0);
    if seq == 0 {
        // Only possible with a tokenizer that adds no special tokens, on empty texts.
        return Err(data_error("text batch", "every item tokenised to no tokens"));
    }
    let mut tokens = vec![tokenizer.pad_id(); batch * seq];
    let mut token_types = vec![tokenizer.pad_type_id(); batch * seq];
    let mut mask = vec![0u32; batch * seq];
    for (row, item) in items.iter().enumerate() {
        let enc = item.encoded;
        let n = enc.ids.len();
        let at = row * seq;
        tokens[at..at + n].copy_from_slice(&enc.ids);
        token_types[at..at + n].copy_from_slice(&enc.type_ids);
        mask[at..at + n].fill(1);
    }
    let host = HostBatch {
        batch,
        seq,
        tokens: Some(tokens),
        token_types: Some(token_types),
        attention_mask: Some(mask),
        pixels: None,
        targets: items.iter().map(|item| item.label).collect(),
        position_offset: 0,
        whole_seq: 0,
        sample_offset,
        sample_ids: items.iter().map(|item| item.id).collect(),
        hidden: None,
    };
    Ok(TextBatch {
        host,
        lengths: items.iter().map(|item| item.encoded.ids.len()).collect(),
        truncated: items.iter().map(|item| item.encoded.truncated).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::text::tokenizer::tests::{CLS, SEP, tiny};

    fn item(id: u64, input: TextInput<'_>, label: u32) -> TextItem<'_> {
        TextItem { id, input, label }
    }

    #[test]
    fn pads_to_the_longest_item_with_mask_and_types() {
        let items = [
            item(40, TextInput::Single("hello world"), 1),
            item(41, TextInput::Pair("the cat", "sat on a mat"), 0),
            item(42, TextInput::Single("dog"), 2),
        ];
        let b = text_batch(&tiny(32), &items, 7).unwrap();
        let h = &b.host;
        // Longest: [CLS] the cat [SEP] sat on a mat [SEP] = 9, not max_len = 32.
        assert_eq!((h.batch, h.seq), (3, 9));
        #[rustfmt::skip]
        assert_eq!(h.tokens.as_deref().unwrap(), [
            CLS, 4, 5, SEP, 0, 0, 0, 0, 0,
            CLS, 6, 7, SEP, 8, 9, 12, 10, SEP,
            CLS, 15, SEP, 0, 0, 0, 0, 0, 0,
        ]);
        #[rustfmt::skip]
        assert_eq!(h.token_types.as_deref().unwrap(), [
            0, 0, 0, 0, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 1, 1, 1, 1, 1,
            0, 0, 0, 0, 0, 0, 0, 0, 0,
        ]);
        #[rustfmt::skip]
        assert_eq!(h.attention_mask.as_deref().unwrap(), [
            1, 1, 1, 1, 0, 0, 0, 0, 0,
            1, 1, 1, 1, 1, 1, 1, 1, 1,
            1, 1, 1, 0, 0, 0, 0, 0, 0,
        ]);
        assert_eq!(h.targets, [1, 0, 2]);
        assert_eq!((h.sample_offset, h.position_offset, h.pixels.is_none()), (7, 0, true));
        assert_eq!(b.host.sample_ids, [40, 41, 42]);
        assert_eq!(b.lengths, [4, 9, 3]);
        assert_eq!(b.truncated.iter().filter(|&&t| t).count(), 0);
    }

    #[test]
    fn long_items_are_cut_at_max_len_and_counted() {
        let items = [item(0, TextInput::Single("the cat sat on a mat"), 0), item(1, TextInput::Single("dog"), 0)];
        let b = text_batch(&tiny(5), &items, 0).unwrap();
        assert_eq!(b.host.seq, 5);
        assert_eq!(&b.host.tokens.as_deref().unwrap()[..5], [CLS, 6, 7, 8, SEP]);
        assert_eq!(b.truncated.iter().filter(|&&t| t).count(), 1);
    }

    #[test]
    fn empty_batch_is_an_error() {
        match text_batch(&tiny(8), &[], 0) {
            Err(Error::Data { what, .. }) => assert_eq!(what, "text batch"),
            other => panic!("expected a data error, got {other:?}"),
        }
        match encoded_batch(&tiny(8), &[], 0) {
            Err(Error::Data { what, .. }) => assert_eq!(what, "text batch"),
            other => panic!("expected a data error, got {other:?}"),
        }
        // A caller's encoding with a token type short is named, not a slice panic.
        let encoded = Encoded { ids: vec![1, 2, 3], type_ids: vec![0, 0], truncated: false, text_tokens: 1 };
        match encoded_batch(&tiny(8), &[EncodedItem { id: 7, encoded: &encoded, label: 0 }], 0) {
            Err(Error::Data { message, .. }) => assert!(message.contains("item 7 has 3 token ids and 2 token types")),
            other => panic!("expected a data error, got {other:?}"),
        }
    }

    /// What a training run does: encode every sample once, then batch any of them in any order
    /// later. Each such batch equals tokenising its items in the batch: ids, types, mask,
    /// labels, sample ids, lengths and truncation (one item cut at `max_len`).
    #[test]
    fn samples_encoded_once_batch_as_tokenised_in_the_batch() {
        let tokenizer = tiny(6);
        let items = [
            item(40, TextInput::Single("the cat sat on a mat"), 1),
            item(41, TextInput::Pair("the cat", "dog"), 0),
            item(42, TextInput::Single("dog"), 2),
        ];
        let inputs: Vec<TextInput<'_>> = items.iter().map(|i| i.input).collect();
        let kept = tokenizer.encode_batch(&inputs).unwrap();
        for (picks, offset) in [(vec![2, 0], 9), (vec![1], 0), (vec![0, 1, 2], 3)] {
            let later: Vec<EncodedItem<'_>> = picks
                .iter()
                .map(|&i| EncodedItem { id: items[i].id, encoded: &kept[i], label: items[i].label })
                .collect();
            let want: Vec<TextItem<'_>> = picks.iter().map(|&i| items[i]).collect();
            let want = text_batch(&tokenizer, &want, offset).unwrap();
            assert_eq!(encoded_batch(&tokenizer, &later, offset).unwrap(), want, "items {picks:?}");
        }
        let all = text_batch(&tokenizer, &items, 0).unwrap();
        assert_eq!((all.host.seq, all.truncated), (6, vec![true, false, false]));
    }
}
