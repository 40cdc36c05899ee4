//! The quota ledger's region slices: how [`QuotaCommand::Region`] commands reach the
//! region's [`RegionLedger`] (`crate::core::region::transfer`), which owns the rules of
//! slices and transfers. This file only dispatches, persists and reads; the buckets and
//! leases of the parent module are left alone.

use super::{QuotaLedger, QuotaResponse};
use crate::core::region::transfer::{RegionCommand, RegionLedger};

impl QuotaLedger {
    /// Applies a region command at ledger time `now_ms` (already advanced by the caller).
    pub(super) fn apply_region(&mut self, command: &RegionCommand, now_ms: u64) -> QuotaResponse {
        let before = self.regions.clone();
        let response = self.regions.apply(command, now_ms);
        if self.regions != before {
            self.regions_changed = true;
        }
        QuotaResponse::Region(response)
    }

    /// The region's slices and transfers.
    pub fn regions(&self) -> &RegionLedger {
        &self.regions
    }

    /// A ledger rebuilt by [`QuotaLedger::from_parts`], with its persisted region state.
    #[must_use]
    pub fn with_regions(mut self, regions: RegionLedger) -> Self {
        self.regions = regions;
        self
    }

    /// The region state to persist, when a command changed it since the last call.
    pub(super) fn take_region_changes(&mut self) -> Option<RegionLedger> {
        std::mem::take(&mut self.regions_changed).then(|| self.regions.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PolicyVersions, QuotaCommand};
    use super::*;
    use crate::core::region::transfer::{RegionResponse, Slice, SliceKey};

    fn region(now_ms: u64, command: RegionCommand) -> QuotaCommand {
        QuotaCommand::Region { now_ms, command }
    }

    /// Region commands go through the quota ledger's apply: they move ledger time, a
    /// replayed debit changes nothing, the changed state is handed to the store once, and a
    /// ledger rebuilt from its parts has the same state and digest.
    #[test]
    fn region_commands_apply_persist_and_reload() {
        let mut ledger = QuotaLedger::new();
        let empty_digest = ledger.digest();
        let key = SliceKey::of("d", "k", 0);
        let slice = Slice { global_tokens: 100, tokens: 60 };
        let adopt = region(5, RegionCommand::Adopt { key: key.clone(), slice });
        assert_eq!(ledger.apply(&adopt), QuotaResponse::Region(RegionResponse::Adopted));
        assert_eq!(ledger.last_seen_ms(), 5);
        let debit = region(
            7,
            RegionCommand::Debit { serial: 1, key: key.clone(), recipient: "b".into(), tokens: 20 },
        );
        assert_eq!(ledger.apply(&debit), QuotaResponse::Region(RegionResponse::Debited(1)));
        let changes = ledger.take_changes();
        let persisted = changes.regions.expect("the region state changed");
        assert_eq!(persisted.slice(&key), Some(Slice { global_tokens: 100, tokens: 40 }));
        assert_eq!(
            persisted.outgoing().map(|(_, transfer)| transfer.debited_at_ms).next(),
            Some(7)
        );
        assert_eq!(ledger.apply(&debit), QuotaResponse::Region(RegionResponse::Debited(1)));
        assert_eq!(ledger.take_changes().regions, None, "a replay changes nothing");
        assert_ne!(ledger.digest(), empty_digest);
        let reloaded = QuotaLedger::from_parts(ledger.last_seen_ms(), PolicyVersions::new(), [])
            .expect("no keys")
            .with_regions(persisted);
        assert_eq!(reloaded.regions(), ledger.regions());
        assert_eq!(reloaded.digest(), ledger.digest());
    }
}
