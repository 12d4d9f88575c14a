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
    Tombstone => "tombstone",
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
    /// The text the message id was made from, when it was not a UUID.
    pub message_key: Option<String>,
    /// Not parked but passed over, counted (`on_tombstone = "skip"`): the partition's offset
    /// moves past it in its batch's transaction, and nothing is applied or stored.
    pub skip: bool,
}

impl Rejection {
    pub fn new(reason: Reason, detail: impl Into<String>) -> Self {
        Rejection {
            reason,
            detail: detail.into(),
            message_id: None,
            message_key: None,
            skip: false,
        }
    }

    /// Attaches the message id, for rejections raised after decoding (window, handler, retries).
    pub fn with_message_id(mut self, id: Uuid) -> Self {
        self.message_id = Some(id);
        self
    }

    /// Attaches the message id and the text it was made from (`None` for a UUID id).
    pub fn with_key(mut self, id: Uuid, text: Option<String>) -> Self {
        self.message_id = Some(id);
        self.message_key = text;
        self
    }

    /// Attaches a decoded message's id and its text.
    pub fn for_envelope(self, env: &crate::envelope::Envelope) -> Self {
        self.with_key(env.message_id, env.message_key.clone())
    }
}
