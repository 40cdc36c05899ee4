//! What a region's quota group knows about slices and transfers, and the idempotent
//! commands that move tokens between regions.
//!
//! A transfer moves tokens of one rule's slice from a donor region to a recipient region.
//! Each side changes its own state only through its own Raft group, so every step below is
//! a command applied by one region's [`RegionLedger`], and every command is idempotent by
//! [`TransferId`] (the donor's name and a serial the donor assigns in order):
//!
//! ```text
//!  donor                                         recipient
//!  Debit{serial}: slice -= n, record in flight
//!     ── credit(id, n) ── QUIC, retried with the same id ──▶  Credit{id}: first time
//!                                                              slice += n, record Credited
//!     ◀── Credited ───────────────────────────────────────── (a replay answers the same)
//!  Settle{Credited}: forget the record
//!
//!  after the transfer timeout, instead:
//!     ── cancel(id) ─────────────────────────────────────▶  Cancel{id}: not credited yet:
//!                                                              record Cancelled (a later
//!                                                              Credit is refused)
//!     ◀── Cancelled (or Credited, if the credit won) ───────
//!  Settle{Cancelled}: slice += n (the return)     Settle{Credited}: forget the record
//! ```
//!
//! **Conservation.** For every rule, at every instant (at most, once a changed limit
//! rounded some tokens away, below):
//!
//! ```text
//!   sum over regions of slice  +  tokens in flight  ==  the rule's global limit
//!   in flight = transfers the donor has debited and not settled, that the recipient
//!               has not credited
//! ```
//!
//! It holds because each token moves by exactly one committed command: the debit takes it
//! out of the donor's slice, then exactly one of the recipient's credit or the donor's
//! return puts it back in a slice. Credit and return exclude each other: the donor returns
//! only after the recipient committed a `Cancelled` record for the id, and a recipient that
//! holds one refuses the credit. So a timeout never decides a count: it only decides when
//! the donor asks to cancel, and a recipient that cannot be reached keeps the tokens in
//! flight (counted, never lost, never doubled) until it answers. Duplicated, reordered or
//! replayed messages meet the recorded outcome of their id.
//!
//! **A changed limit.** When a policy changes a sliced rule's global limit from `G` to
//! `G'`, each region scales what it holds by `G' / G`, rounding down
//! ([`RegionCommand::Relimit`], once per change): its slice, and the tokens of every
//! transfer it has in flight, which so count against a cut like tokens in a slice. Tokens
//! are counted under the limit of the slice they are in or were debited from, so the
//! invariant above is, while regions move one after another:
//!
//! ```text
//!   sum over slices and transfers in flight of  tokens / the limit they are counted under  <= 1
//! ```
//!
//! Scaling keeps each term's share and rounding only lowers it, so once every region moved,
//! slices plus tokens in flight are at most `G'` and less than it by under one token per
//! slice and transfer. A credit carries the limit its tokens are counted under, and a
//! recipient whose slice is under another one refuses it for now
//! ([`RegionCommandError::LimitChanged`]): the donor resends it scaled once both moved, or
//! cancels it. What earlier transfers moved stays where it went, in proportion. (Moving each
//! slice by its change of policy slice instead cannot work locally: a region that gave its
//! slice away cannot pay its part of a cut, and holding it at 0 creates tokens.) A limit of
//! 0 is not scaled to: the policy enforces it (a slice is served at most at the limit), and
//! the slices keep their shares for when it is raised again; so a slice under a limit of 0
//! was adopted at 0, holds nothing and never did, and takes its policy slice as an adopt
//! would. A change of shares alone moves no slice: the shares are where slices drift back
//! to (`plan.rs`).
//!
//! **Bounded state.** A donor keeps at most [`TRANSFERS_IN_FLIGHT_MAX`] unsettled transfers.
//! A recipient keeps the outcome of each id until the donor says it settled it: every
//! message carries the donor's lowest unsettled serial toward that recipient
//! (`settled_below`), and the recipient forgets the donor's records below it; a message for
//! an id below it changes nothing. A recipient holding [`RECEIVED_PER_DONOR_MAX`] outcomes
//! of one donor (an old transfer unanswered while later ones settled) refuses new ones as
//! busy until the old one settles. The region's count of offered hits
//! ([`RegionCommand::Demand`], `demand.rs`) is kept for sliced limits only, and per limit for
//! at most `REPORTING_NODES_MAX` nodes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::check_region_name;
use super::demand::OfferedHits;
use crate::core::ledger::NodeId;
use crate::core::rate::LIMIT_TOKENS_MAX;

/// Most transfers a donor keeps in flight at once (all rules and recipients together).
pub const TRANSFERS_IN_FLIGHT_MAX: usize = 256;
/// Most outcomes a recipient keeps per donor awaiting the donor's settlement.
pub const RECEIVED_PER_DONOR_MAX: usize = TRANSFERS_IN_FLIGHT_MAX;
/// Most rules with a slice in one region's ledger.
pub const SLICED_RULES_MAX: usize = 10_000;
/// Longest slice key, in bytes.
pub const SLICE_KEY_BYTES_MAX: usize = 1024;

const _: () = assert!(RECEIVED_PER_DONOR_MAX >= TRANSFERS_IN_FLIGHT_MAX);

/// Names one sliced limit alike in every region: its domain, its rule's path and the
/// limit's position in the rule (`domain/path#index`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SliceKey(pub String);

impl SliceKey {
    /// The key of the `limit_index`-th limit of the rule at `path` in `domain`.
    #[must_use]
    pub fn of(domain: &str, path: &str, limit_index: usize) -> Self {
        Self(format!("{domain}/{path}#{limit_index}"))
    }
}

impl std::fmt::Display for SliceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One transfer: the donor region's name and the serial it gave the debit.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TransferId {
    /// The donor region.
    pub donor: String,
    /// The donor's serial, from 1, in the order of its debits.
    pub serial: u64,
}

impl std::fmt::Display for TransferId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.donor, self.serial)
    }
}

/// A rule's slice in this region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    /// The rule's global limit (tokens per window), from the policy.
    pub global_tokens: u64,
    /// This region's slice of it now.
    pub tokens: u64,
}

/// A transfer this region debited and has not settled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outgoing {
    /// The rule.
    pub key: SliceKey,
    /// The recipient region.
    pub recipient: String,
    /// Tokens in flight: debited, under the slice's limit (a changed limit scales them).
    pub tokens: u64,
    /// Ledger time of the debit: the rebalancer asks to cancel after its timeout.
    pub debited_at_ms: u64,
}

/// What a recipient did with a transfer id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Received {
    /// The tokens were added to the recipient's slice.
    Credited,
    /// The donor asked to cancel before any credit: a credit is refused from now on.
    Cancelled,
}

/// A command of a region's quota group about slices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegionCommand {
    /// Sets a rule's slice from the policy when the ledger has none yet (a later policy
    /// for a known rule moves it by [`RegionCommand::Relimit`] only, and by transfers).
    Adopt {
        /// The rule.
        key: SliceKey,
        /// The rule's global limit and this region's share of it.
        slice: Slice,
    },
    /// Donor: takes `tokens` out of the slice, in flight to `recipient`.
    Debit {
        /// Must be the ledger's next serial; a replay of an applied debit repeats its answer.
        serial: u64,
        /// The rule.
        key: SliceKey,
        /// The recipient region.
        recipient: String,
        /// Tokens to move, at least 1.
        tokens: u64,
    },
    /// Recipient: a donor's credit or cancellation of a transfer.
    Receive(TransferRequest),
    /// Donor: records the recipient's answer; `Cancelled` returns the tokens to the slice.
    Settle {
        /// The donor's serial of the transfer.
        serial: u64,
        /// What the recipient did.
        outcome: Received,
    },
    /// A rule's global limit changed in the policy: the slice and the tokens of this
    /// region's transfers of the rule in flight are scaled by `to / from`, rounding down (a
    /// slice under a limit of 0 takes `to_policy_tokens`). Applied once: a slice not under
    /// `from_global_tokens` is left alone. A new limit of 0 is refused
    /// ([`RegionCommandError::ZeroLimit`]).
    Relimit {
        /// The rule.
        key: SliceKey,
        /// The global limit the slice is under now.
        from_global_tokens: u64,
        /// The new global limit, at least 1.
        to_global_tokens: u64,
        /// This region's policy slice of the new limit.
        to_policy_tokens: u64,
    },
    /// Any node of the region: its own counts of offered hits on sliced limits
    /// (`demand.rs`, [`OfferedHits`]); answered with the slices of those limits, which is
    /// how a gateway, holding no replica, learns what to enforce.
    Demand {
        /// The reporting node.
        node_id: NodeId,
        /// `(limit, the node's count of hits offered on it)`, at most [`SLICED_RULES_MAX`];
        /// a limit with no slice here is skipped.
        hits: Vec<(SliceKey, u64)>,
    },
}

/// What a donor asks a recipient about one transfer: the messages regions exchange, and
/// the recipient's command for each.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransferRequest {
    /// Add the transfer's tokens to the slice, once per id.
    Credit {
        /// The transfer.
        id: TransferId,
        /// The rule.
        key: SliceKey,
        /// Tokens moved.
        tokens: u64,
        /// The global limit the tokens are counted under: the donor's slice's when it sent
        /// the credit (its transfers in flight scale with its slice).
        global_tokens: u64,
        /// The donor's lowest unsettled serial toward the recipient.
        settled_below: u64,
    },
    /// Refuse the transfer from now on, unless it was already credited.
    Cancel {
        /// The transfer.
        id: TransferId,
        /// The donor's lowest unsettled serial toward the recipient.
        settled_below: u64,
    },
}

impl TransferRequest {
    /// The transfer the request is about.
    #[must_use]
    pub fn id(&self) -> &TransferId {
        match self {
            Self::Credit { id, .. } | Self::Cancel { id, .. } => id,
        }
    }
}

/// Why a command changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RegionCommandError {
    /// The rule has no slice in this region (its policy has not been adopted).
    #[error("no slice for {0}")]
    UnknownSlice(SliceKey),
    /// Adopting one more rule would exceed [`SLICED_RULES_MAX`], or the key is too long.
    #[error("cannot hold a slice for {0}: key too long or too many sliced rules")]
    SliceKey(SliceKey),
    /// A slice larger than its global limit, or a global limit above the largest limit.
    #[error("a slice of {tokens} tokens does not fit a global limit of {global_tokens}")]
    SliceTooLarge {
        /// The slice.
        tokens: u64,
        /// The global limit.
        global_tokens: u64,
    },
    /// A recipient or donor name that is no valid region name.
    #[error("invalid region name {0:?}")]
    RegionName(String),
    /// A debit of 0 tokens, or of more than the slice holds.
    #[error("cannot debit {tokens} tokens from a slice of {available}")]
    Insufficient {
        /// Tokens asked.
        tokens: u64,
        /// Tokens in the slice.
        available: u64,
    },
    /// A debit whose serial is not the next one and is no replay of an applied debit.
    #[error("debit serial {offered} is not the next serial {next}")]
    Serial {
        /// The serial offered.
        offered: u64,
        /// The next serial.
        next: u64,
    },
    /// [`TRANSFERS_IN_FLIGHT_MAX`] transfers are in flight, or the recipient holds
    /// [`RECEIVED_PER_DONOR_MAX`] unsettled outcomes of this donor: retry after settling.
    /// (The donor's `settled_below` carried by the refused command is still recorded: it
    /// only ever frees room.)
    #[error("too many transfers awaiting settlement")]
    Busy,
    /// A demand report naming more than [`SLICED_RULES_MAX`] limits.
    #[error("a demand report of {0} limits, over the maximum of {SLICED_RULES_MAX}")]
    ReportTooLarge(usize),
    /// A credit counted under another global limit than the recipient's slice is: one of
    /// the two regions has not moved to a changed limit yet. Retry once both have (the
    /// donor's credit is then scaled), or cancel.
    #[error(
        "a credit counted under a global limit of {credit_global_tokens}, the slice is under {slice_global_tokens}"
    )]
    LimitChanged {
        /// The credit's limit.
        credit_global_tokens: u64,
        /// The recipient's slice's limit.
        slice_global_tokens: u64,
    },
    /// A relimit to a global limit of 0: the policy enforces it, and the slice keeps its
    /// share for a later limit.
    #[error("a sliced limit of 0 is enforced by the policy, not moved to: {0}")]
    ZeroLimit(SliceKey),
}

/// The answer to a [`RegionCommand`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegionResponse {
    /// Adopted, or already known.
    Adopted,
    /// The debit is recorded (or was: a replay) under this serial; the transfer's id is the
    /// donor region's name with it.
    Debited(u64),
    /// The recipient's outcome for the id (the same for every replay).
    Received(Received),
    /// The id is below the donor's settled watermark: the donor has its outcome already.
    AlreadySettled,
    /// The donor recorded the outcome (or had: a replay).
    Settled,
    /// Refused; nothing changed.
    Refused(RegionCommandError),
    /// The answer to a [`RegionCommand::Demand`]: the slice of each reported limit that has
    /// one, in tokens.
    Slices(Vec<(SliceKey, u64)>),
    /// The slice after a [`RegionCommand::Relimit`] (or as it was, for a replay).
    Relimited(Slice),
}

/// The outcomes a recipient keeps for one donor.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DonorRecords {
    /// Every serial below it is settled at the donor.
    pub settled_below: u64,
    /// Outcomes by serial, at or above `settled_below`.
    pub outcomes: BTreeMap<u64, Received>,
}

/// A region's slices and transfers: the part of its quota group's state this module owns.
///
/// It does not know its own region's name: the rebalancer, which does, names transfers
/// ([`TransferId`]) and only sends a credit to, or accepts one from, another region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionLedger {
    slices: BTreeMap<SliceKey, Slice>,
    /// The serial the next debit gets (serials start at 1).
    next_serial: u64,
    outgoing: BTreeMap<u64, Outgoing>,
    received: BTreeMap<String, DonorRecords>,
    /// The region's offered hits per sliced limit (only limits with a slice, so bounded by
    /// [`SLICED_RULES_MAX`]).
    offered: BTreeMap<SliceKey, OfferedHits>,
}

impl Default for RegionLedger {
    fn default() -> Self {
        Self {
            slices: BTreeMap::new(),
            next_serial: 1,
            outgoing: BTreeMap::new(),
            received: BTreeMap::new(),
            offered: BTreeMap::new(),
        }
    }
}

impl RegionLedger {
    /// True while no rule has a slice and nothing was ever transferred: nothing to persist.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// A rule's slice here.
    #[must_use]
    pub fn slice(&self, key: &SliceKey) -> Option<Slice> {
        self.slices.get(key).copied()
    }

    /// Every slice, by rule.
    pub fn slices(&self) -> impl Iterator<Item = (&SliceKey, &Slice)> {
        self.slices.iter()
    }

    /// Transfers debited and not settled, by serial.
    pub fn outgoing(&self) -> impl Iterator<Item = (u64, &Outgoing)> {
        self.outgoing.iter().map(|(serial, transfer)| (*serial, transfer))
    }

    /// The serial of the next debit: what the leader proposes a [`RegionCommand::Debit`] with.
    #[must_use]
    pub fn next_serial(&self) -> u64 {
        self.next_serial
    }

    /// The lowest serial of a transfer to `recipient` not settled (the next serial when
    /// none is): every message to the recipient carries it, and the recipient forgets the
    /// outcomes below it.
    #[must_use]
    pub fn settled_below(&self, recipient: &str) -> u64 {
        self.outgoing
            .iter()
            .find(|(_, transfer)| transfer.recipient == recipient)
            .map_or(self.next_serial, |(serial, _)| *serial)
    }

    /// The credit of this region's transfer `serial`, as region `donor` sends it: the
    /// record's tokens under its slice's current limit, with the watermark toward its
    /// recipient; `None` once settled. Read from one state, so tokens and limit agree.
    #[must_use]
    pub fn credit_request(&self, donor: &str, serial: u64) -> Option<(String, TransferRequest)> {
        let transfer = self.outgoing.get(&serial)?;
        let slice = self
            .slices
            .get(&transfer.key)
            .expect("a debited slice is never forgotten while its transfer is in flight");
        let request = TransferRequest::Credit {
            id: TransferId { donor: donor.to_owned(), serial },
            key: transfer.key.clone(),
            tokens: transfer.tokens,
            global_tokens: slice.global_tokens,
            settled_below: self.settled_below(&transfer.recipient),
        };
        Some((transfer.recipient.clone(), request))
    }

    /// The transfers of other regions this region credited and whose donors have not said
    /// they settled them, as `(donor, serial)`.
    pub fn credited(&self) -> impl Iterator<Item = (&str, u64)> {
        self.received.iter().flat_map(|(donor, records)| {
            records
                .outcomes
                .iter()
                .filter(|(_, outcome)| **outcome == Received::Credited)
                .map(move |(serial, _)| (donor.as_str(), *serial))
        })
    }

    /// The region-wide count of hits offered on a sliced limit (0 before any report).
    #[must_use]
    pub fn offered_hits(&self, key: &SliceKey) -> u64 {
        self.offered.get(key).map_or(0, OfferedHits::hits_total)
    }

    /// What this region did with a transfer id, when it still knows; `AlreadySettled`-like
    /// ids (below the donor's watermark) answer `None`.
    #[must_use]
    pub fn received(&self, id: &TransferId) -> Option<Received> {
        self.received.get(&id.donor)?.outcomes.get(&id.serial).copied()
    }

    /// Applies one command; a refused command changes nothing but the donor's watermark a
    /// credit or cancellation carries (it only frees room).
    /// `now_ms` is ledger time (the debit's, for its timeout).
    pub fn apply(&mut self, command: &RegionCommand, now_ms: u64) -> RegionResponse {
        let outcome = match command {
            RegionCommand::Adopt { key, slice } => self.adopt(key, *slice),
            RegionCommand::Debit { serial, key, recipient, tokens } => {
                self.debit(now_ms, *serial, key, recipient, *tokens)
            }
            RegionCommand::Receive(TransferRequest::Credit {
                id,
                key,
                tokens,
                global_tokens,
                settled_below,
            }) => self.receive(id, *settled_below, Some((key, *tokens, *global_tokens))),
            RegionCommand::Receive(TransferRequest::Cancel { id, settled_below }) => {
                self.receive(id, *settled_below, None)
            }
            RegionCommand::Settle { serial, outcome } => Ok(self.settle(*serial, *outcome)),
            RegionCommand::Demand { node_id, hits } => self.demand(now_ms, *node_id, hits),
            RegionCommand::Relimit {
                key,
                from_global_tokens,
                to_global_tokens,
                to_policy_tokens,
            } => self.relimit(key, *from_global_tokens, *to_global_tokens, *to_policy_tokens),
        };
        outcome.unwrap_or_else(RegionResponse::Refused)
    }

    fn adopt(
        &mut self,
        key: &SliceKey,
        slice: Slice,
    ) -> Result<RegionResponse, RegionCommandError> {
        if slice.tokens > slice.global_tokens || slice.global_tokens > LIMIT_TOKENS_MAX {
            return Err(RegionCommandError::SliceTooLarge {
                tokens: slice.tokens,
                global_tokens: slice.global_tokens,
            });
        }
        if self.slices.contains_key(key) {
            return Ok(RegionResponse::Adopted);
        }
        if key.0.len() > SLICE_KEY_BYTES_MAX || self.slices.len() >= SLICED_RULES_MAX {
            return Err(RegionCommandError::SliceKey(key.clone()));
        }
        self.slices.insert(key.clone(), slice);
        Ok(RegionResponse::Adopted)
    }

    fn debit(
        &mut self,
        now_ms: u64,
        serial: u64,
        key: &SliceKey,
        recipient: &str,
        tokens: u64,
    ) -> Result<RegionResponse, RegionCommandError> {
        if serial < self.next_serial {
            // A replay of an applied debit (its answer was lost) repeats it; anything else
            // under an old serial is a stale proposal.
            return match self.outgoing.get(&serial) {
                Some(transfer)
                    if transfer.key == *key
                        && transfer.recipient == recipient
                        && transfer.tokens == tokens =>
                {
                    Ok(RegionResponse::Debited(serial))
                }
                _ => Err(RegionCommandError::Serial { offered: serial, next: self.next_serial }),
            };
        }
        if check_region_name(recipient).is_err() {
            return Err(RegionCommandError::RegionName(recipient.to_owned()));
        }
        if serial > self.next_serial {
            return Err(RegionCommandError::Serial { offered: serial, next: self.next_serial });
        }
        if self.outgoing.len() >= TRANSFERS_IN_FLIGHT_MAX {
            return Err(RegionCommandError::Busy);
        }
        let slice = self
            .slices
            .get_mut(key)
            .ok_or_else(|| RegionCommandError::UnknownSlice(key.clone()))?;
        if tokens == 0 || tokens > slice.tokens {
            return Err(RegionCommandError::Insufficient { tokens, available: slice.tokens });
        }
        slice.tokens -= tokens;
        self.outgoing.insert(
            serial,
            Outgoing {
                key: key.clone(),
                recipient: recipient.to_owned(),
                tokens,
                debited_at_ms: now_ms,
            },
        );
        self.next_serial += 1;
        Ok(RegionResponse::Debited(serial))
    }

    /// A credit (`Some((key, tokens, global_tokens))`) or a cancellation (`None`) of `id`.
    fn receive(
        &mut self,
        id: &TransferId,
        settled_below: u64,
        credit: Option<(&SliceKey, u64, u64)>,
    ) -> Result<RegionResponse, RegionCommandError> {
        if check_region_name(&id.donor).is_err() {
            return Err(RegionCommandError::RegionName(id.donor.clone()));
        }
        if let Some((key, _, _)) = credit
            && !self.slices.contains_key(key)
        {
            return Err(RegionCommandError::UnknownSlice(key.clone()));
        }
        // The donor's watermark first: it only frees room, whatever becomes of the command.
        let donor = self.received.entry(id.donor.clone()).or_default();
        if settled_below > donor.settled_below {
            donor.settled_below = settled_below;
            donor.outcomes = donor.outcomes.split_off(&settled_below);
        }
        if id.serial < donor.settled_below {
            return Ok(RegionResponse::AlreadySettled);
        }
        // A replay meets the recorded outcome, before any check of a new credit.
        if let Some(outcome) = donor.outcomes.get(&id.serial) {
            return Ok(RegionResponse::Received(*outcome));
        }
        if donor.outcomes.len() >= RECEIVED_PER_DONOR_MAX {
            return Err(RegionCommandError::Busy);
        }
        if let Some((key, tokens, global_tokens)) = credit {
            let slice = self.slices.get(key).expect("checked above");
            if global_tokens != slice.global_tokens {
                return Err(RegionCommandError::LimitChanged {
                    credit_global_tokens: global_tokens,
                    slice_global_tokens: slice.global_tokens,
                });
            }
            if slice.tokens.checked_add(tokens).is_none_or(|sum| sum > slice.global_tokens) {
                return Err(RegionCommandError::SliceTooLarge {
                    tokens: slice.tokens.saturating_add(tokens),
                    global_tokens: slice.global_tokens,
                });
            }
        }
        let outcome = match credit {
            Some((key, tokens, _)) => {
                let slice = self.slices.get_mut(key).expect("checked above");
                slice.tokens += tokens;
                Received::Credited
            }
            None => Received::Cancelled,
        };
        self.received.entry(id.donor.clone()).or_default().outcomes.insert(id.serial, outcome);
        Ok(RegionResponse::Received(outcome))
    }

    fn relimit(
        &mut self,
        key: &SliceKey,
        from_global: u64,
        to_global: u64,
        to_policy: u64,
    ) -> Result<RegionResponse, RegionCommandError> {
        if to_global > LIMIT_TOKENS_MAX || to_policy > to_global {
            return Err(RegionCommandError::SliceTooLarge {
                tokens: to_policy,
                global_tokens: to_global,
            });
        }
        if to_global == 0 {
            return Err(RegionCommandError::ZeroLimit(key.clone()));
        }
        let slice = self
            .slices
            .get_mut(key)
            .ok_or_else(|| RegionCommandError::UnknownSlice(key.clone()))?;
        if slice.global_tokens != from_global {
            return Ok(RegionResponse::Relimited(*slice));
        }
        if from_global == 0 {
            // Adopted at 0 (a relimit never goes there): nothing was ever held or moved.
            assert_eq!(slice.tokens, 0, "a slice is never above its limit");
            *slice = Slice { global_tokens: to_global, tokens: to_policy };
            return Ok(RegionResponse::Relimited(*slice));
        }
        let scale = |tokens: u64| -> u64 {
            let scaled = u128::from(tokens) * u128::from(to_global) / u128::from(from_global);
            u64::try_from(scaled).expect("tokens at most the old limit scale to at most the new")
        };
        *slice = Slice { global_tokens: to_global, tokens: scale(slice.tokens) };
        // Tokens in flight are counted under the donor's slice's limit until they land:
        // scaled alike, a cut takes its share of them whether they are credited or returned.
        for transfer in self.outgoing.values_mut().filter(|transfer| transfer.key == *key) {
            transfer.tokens = scale(transfer.tokens);
        }
        Ok(RegionResponse::Relimited(*slice))
    }

    fn demand(
        &mut self,
        now_ms: u64,
        node_id: NodeId,
        hits: &[(SliceKey, u64)],
    ) -> Result<RegionResponse, RegionCommandError> {
        if hits.len() > SLICED_RULES_MAX {
            return Err(RegionCommandError::ReportTooLarge(hits.len()));
        }
        let mut slices = Vec::with_capacity(hits.len());
        for (key, hits_total) in hits {
            let Some(slice) = self.slices.get(key) else { continue };
            slices.push((key.clone(), slice.tokens));
            self.offered.entry(key.clone()).or_default().record(node_id, *hits_total, now_ms);
        }
        Ok(RegionResponse::Slices(slices))
    }

    fn settle(&mut self, serial: u64, outcome: Received) -> RegionResponse {
        if let Some(transfer) = self.outgoing.remove(&serial)
            && outcome == Received::Cancelled
        {
            let slice = self
                .slices
                .get_mut(&transfer.key)
                .expect("a debited slice is never forgotten while its transfer is in flight");
            slice.tokens += transfer.tokens;
        }
        RegionResponse::Settled
    }
}
