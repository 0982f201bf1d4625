//! Output token ids back to text, as an engine's own OpenAI server turns them into text: what a
//! gateway must do itself when a worker answers with token ids only (SMG's gRPC worker protocol).
//!
//! ```text
//! token ids ─► Detokenizer (incremental: text only once its characters are whole)
//!           ─► SequenceText (stop strings matched and trimmed; a stream holds back what a stop
//!              string may still claim) ─► deltas for the stream, the final text
//! ```
//!
//! Both follow vLLM's detokenizer (v1, fast tokenizers): the decode stream is primed with the
//! prompt, so the first output token decodes in context; text is released only when the decoded
//! string grew and does not end in U+FFFD (a character whose bytes are still arriving), so no
//! multi-byte character is ever split and no text is ever taken back; stop strings are searched
//! in the new text only and the earliest-ending one wins; a streamed sequence holds back
//! `longest stop string - 1` characters until it finishes.

use std::collections::HashSet;
use std::sync::Arc;

use tokenizers::Tokenizer;

use crate::TokenizeError;

/// Incremental detokenization of one sequence.
///
/// Written on `Tokenizer::decode` rather than `tokenizers`' own `DecodeStream` because that one
/// borrows the tokenizer (a sequence here outlives any borrow: it lives in a response stream) and,
/// in the version kvgate pins, cannot be primed with the prompt as vLLM primes it. The state and
/// the rule are the same: the ids since the last released text, the text they decode to, and where
/// the newest text starts.
#[derive(Clone)]
pub struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    /// The tokenizer's special tokens (see [`special_ids`]).
    special_ids: Arc<HashSet<u32>>,
    skip_special_tokens: bool,
    /// Ids not yet dropped: the context the next token decodes in.
    ids: Vec<u32>,
    /// What `ids[..prefix_index]` decodes to; empty until known.
    prefix: String,
    /// How many of `ids` the released text covers as context.
    prefix_index: usize,
    /// The prompt's last tokens, until the first output token primes the decode with them.
    unprimed: Vec<u32>,
    /// Whether an output token was stepped (before, nothing is pending: the prompt is not output).
    stepped: bool,
}

/// The most prompt tokens the decode is primed with: vLLM tries suffixes of 4 to 23 tokens.
const PRIME_WINDOW: usize = 23;
/// The shortest prompt suffix vLLM primes with.
const PRIME_MIN: usize = 4;

impl std::fmt::Debug for Detokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Detokenizer")
            .field("skip_special_tokens", &self.skip_special_tokens)
            .field("ids", &self.ids.len())
            .finish_non_exhaustive()
    }
}

impl Detokenizer {
    /// A detokenizer for a sequence generated after `prompt` (whose ids give the first output
    /// tokens their context, as vLLM's detokenizer has it); `special_ids` are the tokenizer's
    /// [`special_ids`], found once for all its sequences.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        special_ids: Arc<HashSet<u32>>,
        prompt: &[u32],
        skip_special_tokens: bool,
    ) -> Self {
        Detokenizer {
            tokenizer,
            special_ids,
            skip_special_tokens,
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
            unprimed: prompt[prompt.len().saturating_sub(PRIME_WINDOW)..].to_vec(),
            stepped: false,
        }
    }

    /// Steps through the prompt's tail, its text discarded, so that the first output token decodes
    /// in context, as vLLM primes its decode stream: the shortest suffix of 4 to 23 tokens that
    /// decodes without U+FFFD (a prompt that ends mid-character then leaves its last bytes pending,
    /// for the output to complete), or all the window when none does (vLLM would then take the
    /// whole prompt; decoding thousands of tokens per sequence for that rare case is not worth it).
    fn prime(&mut self) -> Result<(), TokenizeError> {
        let window = std::mem::take(&mut self.unprimed);
        let mut context: &[u32] = &window;
        for len in PRIME_MIN..=window.len() {
            let suffix = &window[window.len() - len..];
            if !self.decode(suffix)?.contains('\u{FFFD}') {
                context = suffix;
                break;
            }
        }
        for &id in context {
            self.step(id)?;
        }
        self.stepped = false;
        Ok(())
    }

    /// The tokenizer's special tokens: the only tokens (with a request's own stop token ids) a
    /// worker can stop on, which are then no text.
    pub fn special_ids(&self) -> &Arc<HashSet<u32>> {
        &self.special_ids
    }

    /// The text of `ids` decoded whole (a prompt echoed back).
    pub fn text_of(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizeError> {
        self.tokenizer.decode(ids, skip_special_tokens).map_err(|e| TokenizeError::Decode(e.to_string()))
    }

    /// Names this sequence's tokens in `logprobs` as `style`'s server does.
    pub fn token_names(&self, style: crate::token_names::NameStyle) -> crate::token_names::TokenNames {
        crate::token_names::TokenNames::new(self.tokenizer.clone(), style)
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tokenizer.decode(ids, self.skip_special_tokens).map_err(|e| TokenizeError::Decode(e.to_string()))
    }

    /// The text `id` adds; empty while the characters it starts are incomplete (their text comes
    /// with a later token) or when it adds nothing (a skipped special token).
    pub fn step(&mut self, id: u32) -> Result<String, TokenizeError> {
        if !self.unprimed.is_empty() {
            self.prime()?;
        }
        self.stepped = true;
        match self.try_step(id) {
            Ok(text) => Ok(text),
            // A tokenizer can decode a longer sequence to a string that does not extend the shorter
            // one's (invalid UTF-8 repaired differently): start over from this token alone, as
            // vLLM does, rather than fail the response.
            Err(StepError::InvalidPrefix) => {
                self.ids.clear();
                self.prefix.clear();
                self.prefix_index = 0;
                match self.try_step(id) {
                    Ok(text) => Ok(text),
                    Err(StepError::InvalidPrefix) => Ok(String::new()),
                    Err(StepError::Decode(e)) => Err(e),
                }
            }
            Err(StepError::Decode(e)) => Err(e),
        }
    }

    /// The text of the tokens stepped but not yet released (characters still incomplete, decoded
    /// with U+FFFD in their place): what a runtime that emits a sequence's tail when it finishes
    /// (SGLang) adds at the end, and vLLM never does.
    pub fn pending(&self) -> Result<String, TokenizeError> {
        if !self.stepped || self.ids.len() <= self.prefix_index {
            return Ok(String::new());
        }
        let text = self.decode(&self.ids)?;
        Ok(text.strip_prefix(self.prefix.as_str()).unwrap_or_default().to_owned())
    }

    fn try_step(&mut self, id: u32) -> Result<String, StepError> {
        self.ids.push(id);
        let text = self.decode(&self.ids)?;
        if text.len() <= self.prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let Some(new_text) = text.strip_prefix(self.prefix.as_str()) else {
            return Err(StepError::InvalidPrefix);
        };
        let new_text = new_text.to_owned();
        let new_prefix_index = self.ids.len() - self.prefix_index;
        self.ids.drain(..self.prefix_index);
        self.prefix = self.decode(&self.ids)?;
        self.prefix_index = new_prefix_index;
        Ok(new_text)
    }
}

/// The ids of `tokenizer`'s special tokens.
pub fn special_ids(tokenizer: &Tokenizer) -> HashSet<u32> {
    tokenizer.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id).collect()
}

enum StepError {
    InvalidPrefix,
    Decode(TokenizeError),
}

impl From<TokenizeError> for StepError {
    fn from(e: TokenizeError) -> Self {
        StepError::Decode(e)
    }
}

/// What ends a sequence's text early, as the request asked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopRule {
    /// Stop strings (OpenAI `stop`).
    pub stop: Vec<String>,
    /// Keep the matched stop string in the text (vLLM's `include_stop_str_in_output`).
    pub include_stop_str_in_output: bool,
    /// Stop strings are not looked for until this many tokens were generated (`min_tokens`).
    pub min_tokens: usize,
}

/// A sequence's text, with its stop strings and what of it a stream has been sent.
#[derive(Debug, Clone)]
pub struct SequenceText {
    detokenizer: Detokenizer,
    rule: StopRule,
    /// Characters a stream holds back: a stop string may still complete over them and cut them.
    holdback_chars: usize,
    text: String,
    tokens: usize,
    /// Bytes of `text` already sent as deltas.
    sent: usize,
    stopped: Option<String>,
}

impl SequenceText {
    /// The text of a sequence decoded by `detokenizer`, ended by `rule`.
    pub fn new(detokenizer: Detokenizer, rule: StopRule) -> Self {
        let holdback_chars = if rule.include_stop_str_in_output {
            0
        } else {
            rule.stop.iter().map(|s| s.chars().count()).max().unwrap_or(1).saturating_sub(1)
        };
        SequenceText { detokenizer, rule, holdback_chars, text: String::new(), tokens: 0, sent: 0, stopped: None }
    }

    /// Adds generated tokens. `stop_terminated`: the last of them is the end-of-sequence or stop
    /// token the engine stopped on, which is not part of the text unless the request keeps stops.
    /// Returns the stop string matched, if these tokens completed one; the text then ends there and
    /// later tokens are ignored.
    pub fn push(&mut self, ids: &[u32], stop_terminated: bool) -> Result<Option<&str>, TokenizeError> {
        if self.stopped.is_some() || ids.is_empty() {
            return Ok(None);
        }
        let (decoded, skipped) = match ids.split_last() {
            Some((last, rest)) if stop_terminated && !self.rule.include_stop_str_in_output => (rest, Some(*last)),
            _ => (ids, None),
        };
        let tokens_before = self.tokens;
        // Where each new token's text ends, to look for stop strings from min_tokens on.
        let mut ends = Vec::with_capacity(decoded.len() + 1);
        ends.push(self.text.len());
        for &id in decoded {
            let piece = self.detokenizer.step(id)?;
            self.text.push_str(&piece);
            self.tokens += 1;
            ends.push(self.text.len());
        }
        self.tokens += usize::from(skipped.is_some());
        if self.rule.stop.is_empty() || self.tokens <= self.rule.min_tokens {
            return Ok(None);
        }
        let from = ends[self.rule.min_tokens.saturating_sub(tokens_before).min(ends.len() - 1)];
        if let Some(found) = find_stop(&self.text, from, &self.rule) {
            // Tokens after the one that completed the stop string (several can arrive at once)
            // are not part of the sequence.
            let kept = ends.iter().skip(1).position(|&end| end >= found.end).map_or(decoded.len(), |i| i + 1);
            self.tokens = tokens_before + kept;
            self.text.truncate(if self.rule.include_stop_str_in_output { found.end } else { found.start });
            self.sent = self.sent.min(self.text.len());
            self.stopped = Some(found.stop);
        }
        Ok(self.stopped.as_deref())
    }

    /// Ends the text with what its last tokens decode to although their characters never
    /// completed (U+FFFD in their place), as SGLang's server ends a finished sequence; vLLM's never
    /// shows them. Nothing after a stop string.
    pub fn flush_incomplete(&mut self) -> Result<(), TokenizeError> {
        if self.stopped.is_none() {
            let tail = self.detokenizer.pending()?;
            self.text.push_str(&tail);
        }
        Ok(())
    }

    /// The stop string that ended the text, if one did.
    pub fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    /// The whole text so far (a finished sequence's text).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Tokens pushed so far (the engine's count of generated tokens).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The text not yet sent; while the sequence runs (`finished` false), the last characters a
    /// stop string could still claim stay back.
    pub fn take_delta(&mut self, finished: bool) -> String {
        let end = if finished || self.stopped.is_some() || self.holdback_chars == 0 {
            self.text.len()
        } else {
            // Where the last `holdback_chars` characters start (all of the text if it is shorter).
            self.text.char_indices().rev().nth(self.holdback_chars - 1).map_or(0, |(i, _)| i)
        };
        if end <= self.sent {
            return String::new();
        }
        let delta = self.text[self.sent..end].to_owned();
        self.sent = end;
        delta
    }
}

/// A stop string found in a sequence's text.
#[derive(Debug, PartialEq, Eq)]
struct FoundStop {
    stop: String,
    /// Byte range of the match.
    start: usize,
    end: usize,
}

/// The stop string that completes earliest in `text` after byte `from` (ties: the first in the
/// request's list).
fn find_stop(text: &str, from: usize, rule: &StopRule) -> Option<FoundStop> {
    let mut best: Option<FoundStop> = None;
    for stop in rule.stop.iter().filter(|s| !s.is_empty()) {
        // A match ending in the new text starts at most its own length minus one before it; a
        // match starts on a character boundary.
        let mut start = from.saturating_sub(stop.len() - 1);
        while !text.is_char_boundary(start) {
            start += 1;
        }
        if let Some(at) = text[start..].find(stop.as_str()).map(|i| i + start) {
            let end = at + stop.len();
            if best.as_ref().is_none_or(|b| end < b.end) {
                best = Some(FoundStop { stop: stop.clone(), start: at, end });
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_earliest_ending_stop_string_wins_and_is_trimmed() {
        let found = |stop: &str, start, end| Some(FoundStop { stop: stop.into(), start, end });
        let rule = StopRule { stop: vec!["world".into(), "lo w".into()], ..Default::default() };
        assert_eq!(find_stop("hello world", 0, &rule), found("lo w", 3, 7));
        // Only text after `from` is new, but a stop string may begin before it.
        assert_eq!(find_stop("hello world", 9, &rule), found("world", 6, 11));
        assert_eq!(find_stop("hello world", 11, &rule), None);
        // Multi-byte text: the search starts on a character boundary.
        let rule = StopRule { stop: vec!["é!".into()], ..Default::default() };
        assert_eq!(find_stop("café!", 4, &rule), found("é!", 3, 6));
    }
}
