//! The messages regions exchange, one request and one reply per QUIC stream, encoded with
//! postcard and bounded by [`MESSAGE_BYTES_MAX`] both ways: a donor's transfer requests,
//! and the pages of views a region reads off its peers to know which of them is hot.

use serde::{Deserialize, Serialize};

use crate::core::region::plan::RegionView;
use crate::core::region::transfer::{Received, SLICE_KEY_BYTES_MAX, SliceKey, TransferRequest};

/// Largest request or reply, in bytes (a transfer message is well under 2 KiB: a slice key
/// of at most 1 KiB and a region name of at most 128 bytes).
pub const MESSAGE_BYTES_MAX: usize = 16 * 1024;
/// Longest reason in a refusal, in bytes.
pub const REASON_BYTES_MAX: usize = 512;
/// Most views in one [`RegionReply::Views`]: each is a slice key and four numbers.
pub const VIEWS_PER_MESSAGE_MAX: usize = 12;

// A page of views of the longest keys fits a message (a view's numbers and length prefixes
// are under 64 bytes as postcard varints).
const _: () = assert!(VIEWS_PER_MESSAGE_MAX * (SLICE_KEY_BYTES_MAX + 64) + 64 <= MESSAGE_BYTES_MAX);

/// What one region asks another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegionRequest {
    /// A donor's credit or cancellation of a transfer, whose id must name the calling region
    /// as its donor (the core's request, `crate::core::region::transfer`).
    Transfer(TransferRequest),
    /// A page of the asked region's views of its sliced limits, in key order after `after`
    /// (from the first when `None`): how a donor learns which peers are hot.
    Views {
        /// The last key of the previous page.
        after: Option<SliceKey>,
    },
}

/// One sliced limit as a region sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleView {
    /// The limit.
    pub key: SliceKey,
    /// The region's slice, policy slice and demand.
    pub view: RegionView,
}

/// The answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegionReply {
    /// A page of views (at most [`VIEWS_PER_MESSAGE_MAX`]); `more` when later keys follow.
    Views {
        /// The views, in key order.
        views: Vec<RuleView>,
        /// Whether to ask for the page after the last key.
        more: bool,
    },
    /// What the recipient did with the id (the same for every replay).
    Received(Received),
    /// The id is below the donor's own settled watermark: nothing to do.
    AlreadySettled,
    /// Not done; `retry` says whether the same request may succeed later (a busy or
    /// leaderless ledger) or never will (a malformed or unauthorised request).
    Refused {
        /// Why, for the logs (at most [`REASON_BYTES_MAX`] bytes).
        reason: String,
        /// Whether retrying may help.
        retry: bool,
    },
}

impl RegionReply {
    /// A refusal, its reason cut to [`REASON_BYTES_MAX`] bytes on a character boundary.
    #[must_use]
    pub fn refused(reason: impl Into<String>, retry: bool) -> Self {
        let mut reason = reason.into();
        if reason.len() > REASON_BYTES_MAX {
            let mut end = REASON_BYTES_MAX;
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            reason.truncate(end);
        }
        Self::Refused { reason, retry }
    }
}

/// A message that cannot be sent or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Larger than [`MESSAGE_BYTES_MAX`].
    #[error("message of {0} bytes, over the maximum of {MESSAGE_BYTES_MAX}")]
    TooLarge(usize),
    /// Not a message of this protocol.
    #[error("undecodable message: {0}")]
    Decode(String),
}

/// Encodes a message within [`MESSAGE_BYTES_MAX`].
///
/// # Errors
/// [`WireError::TooLarge`] when it does not fit.
pub fn encode<T: Serialize>(message: &T) -> Result<Vec<u8>, WireError> {
    let bytes = postcard::to_allocvec(message).expect("postcard encodes these messages into a Vec");
    if bytes.len() > MESSAGE_BYTES_MAX {
        return Err(WireError::TooLarge(bytes.len()));
    }
    Ok(bytes)
}

/// Decodes a message that was read within [`MESSAGE_BYTES_MAX`].
///
/// # Errors
/// [`WireError::Decode`] for bytes that are no such message (trailing bytes included).
pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, WireError> {
    match postcard::take_from_bytes(bytes) {
        Ok((message, [])) => Ok(message),
        Ok((_, rest)) => Err(WireError::Decode(format!("{} trailing bytes", rest.len()))),
        Err(error) => Err(WireError::Decode(error.to_string())),
    }
}
