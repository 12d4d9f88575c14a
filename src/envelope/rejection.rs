//! Why a record cannot be applied: the stable reason codes (stored in `dead_letters.reason`,
//! used as metric labels) and the rejection that carries one with the operator's sentence.

use std::fmt;

use uuid::Uuid;

/// Declares [`Reason`] with its codes in one list, so `ALL` and `as_str` cannot drift from the
/// variants.
macro_rules! reasons {
    ($($variant:ident => $code:literal,)*) => {
        /// Why a record cannot be applied. The codes are stable: they are stored in
        /// `dead_letters.reason` and used as metric labels, so renaming one breaks queries.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Reason { $($variant,)* }

        impl Reason {
            /// Every reason, so metrics can pre-register a zero series for each label.
            pub const ALL: [Reason; [$($code,)*].len()] = [$(Reason::$variant,)*];

            /// The stable snake_case code.
            pub fn as_str(&self) -> &'static str {
                match self { $(Reason::$variant => $code,)* }
            }
        }
    };
}

reasons! {
    MissingEventId => "missing_event_id",
    InvalidEventId => "invalid_event_id",
    EmptyPayload => "empty_payload",
    OversizedPayload => "oversized_payload",
    UndecodablePayload => "undecodable_payload",
    NoEventDate => "no_event_date",
    InvalidEventDate => "invalid_event_date",
    OlderThanRetention => "older_than_retention",
    FutureEventDate => "future_event_date",
    MissingField => "missing_field",
    HandlerRejected => "handler_rejected",
    RetriesExhausted => "retries_exhausted",
    NotWireFormat => "not_wire_format",
    UnknownSchema => "unknown_schema",
    SchemaMismatch => "schema_mismatch",
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a record cannot be applied: a stable `reason` for machines, a `detail` sentence for the
/// operator (the caller adds topic, partition and offset).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {detail}")]
pub struct Rejection {
    pub reason: Reason,
    pub detail: String,
    /// The message id when one was readable, so a parked record can be traced to its producer.
    pub message_id: Option<Uuid>,
}

impl Rejection {
    pub fn new(reason: Reason, detail: impl Into<String>) -> Self {
        Rejection {
            reason,
            detail: detail.into(),
            message_id: None,
        }
    }

    /// Attaches the message id, for rejections raised after decoding (window, handler, retries).
    pub fn with_message_id(mut self, id: Uuid) -> Self {
        self.message_id = Some(id);
        self
    }
}
