//! Planted bugs for the fault campaign (`src/bin/campaign`, docs/CAMPAIGN.md): each [`Mutant`]
//! swaps one small piece of the product for a wrong one, so the campaign can show that its checker
//! catches it. They exist only in a binary built with the `campaign-mutants` feature, which
//! `.ci/campaign` builds into a copy of its own; that binary refuses to start outside the campaign
//! (src/main.rs), and picks the one planted bug from `SETTLEMENTD_CAMPAIGN_MUTANT`. In every other
//! build [`planted`] is a constant `false` and the compiler removes the wrong branches.

/// One planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutant {
    /// The attempt fence's answer is ignored: a batch commits its loans after its claim was taken
    /// over.
    FenceOff,
    /// The claim's `ON CONFLICT DO NOTHING` result is ignored: an existing row is taken as won.
    ClaimIgnoresConflict,
    /// A lease is judged on the claimer's clock, not the database's.
    LeaseLocalClock,
    /// A journal row of a single entry is not written.
    SkipJournal,
    /// A late return is swept under the replica's configured rule, not the month's pin.
    LateUnderConfigRule,
    /// A re-opened month's member statements recompute none of the members its late journal rows
    /// touch, and move the mark past them.
    StatementsReopenSkips,
    /// A loan's money priced in another month or for another member than its head's continues
    /// the head where it was priced, instead of being reversed out of the old place first.
    MoveWithoutReversal,
    /// A claim held under a live lease by another replica is taken over at once, as if it were an
    /// attempt of this process's own that no run here carries on (the own-attempt takeover,
    /// `ClaimOptions::own_dead`, without its "same owner").
    OwnTakeoverOfAPeer,
}

impl Mutant {
    /// Every planted bug, as `SETTLEMENTD_CAMPAIGN_MUTANT` names them.
    pub const ALL: [(Mutant, &'static str); 8] = [
        (Mutant::FenceOff, "fence-off"),
        (Mutant::ClaimIgnoresConflict, "claim-ignores-conflict"),
        (Mutant::LeaseLocalClock, "lease-local-clock"),
        (Mutant::SkipJournal, "skip-journal"),
        (Mutant::LateUnderConfigRule, "late-under-config-rule"),
        (Mutant::StatementsReopenSkips, "statements-reopen-skips"),
        (Mutant::MoveWithoutReversal, "move-without-reversal"),
        (Mutant::OwnTakeoverOfAPeer, "own-takeover-of-a-peer"),
    ];

    /// The bug `SETTLEMENTD_CAMPAIGN_MUTANT` names (`Ok(None)`: unset).
    pub fn from_env() -> Result<Option<Mutant>, String> {
        let Ok(name) = std::env::var("SETTLEMENTD_CAMPAIGN_MUTANT") else {
            return Ok(None);
        };
        Self::ALL
            .iter()
            .find(|(_, n)| *n == name)
            .map(|(m, _)| Some(*m))
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|(_, n)| *n).collect();
                format!(
                    "SETTLEMENTD_CAMPAIGN_MUTANT={name:?}: expected one of {}",
                    names.join(", ")
                )
            })
    }
}

/// Whether `mutant` is the bug this process plants: always `false` outside a `campaign-mutants`
/// build.
#[cfg(not(feature = "campaign-mutants"))]
#[inline(always)]
pub const fn planted(_mutant: Mutant) -> bool {
    false
}

/// Whether `mutant` is the bug this process plants (`SETTLEMENTD_CAMPAIGN_MUTANT`, read once; src/main.rs
/// has refused a bad value before any of this runs).
#[cfg(feature = "campaign-mutants")]
pub fn planted(mutant: Mutant) -> bool {
    static PLANTED: std::sync::OnceLock<Option<Mutant>> = std::sync::OnceLock::new();
    *PLANTED.get_or_init(|| Mutant::from_env().ok().flatten()) == Some(mutant)
}
