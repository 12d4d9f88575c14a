//! The default command (`make demo`): one load run from the command line's flags ([`Args`]),
//! its summary table printed, and the exit status its verdict.

use crate::produce::wire::Format;
use crate::produce::{self, Mix};
use crate::stages::finish;
use crate::{produce_stage, report, Args, Session, Spec};

impl Spec {
    fn from_args(args: &Args) -> anyhow::Result<Spec> {
        Ok(Spec {
            brokers: args.services.brokers.clone(),
            database_url: args.services.database_url.clone(),
            topic: args.topic.clone(),
            partitions: args.partitions,
            consumer: args.consumer.clone(),
            plan: produce::parse_plan(&args.rate, args.duration).map_err(anyhow::Error::msg)?,
            limit: args.count,
            mix: Mix {
                // Via the outbox a resend is the relay's (it is counted on the topic).
                resend: if args.via_outbox {
                    0.0
                } else {
                    args.resend_rate
                },
                redrive: args.redrive_rate,
                redrive_delay: args.redrive_delay,
                double_tap: args.double_tap_rate,
                poison: args.poison_rate,
            },
            users: args.users,
            rate_bp: args.rate_bp,
            drain_timeout: args.drain_timeout,
            report_dir: args.report_dir.clone(),
            seed: args.seed,
            quiet: args.quiet,
            compression: args.compression,
        })
    }
}

pub async fn run(args: Args) -> anyhow::Result<bool> {
    let spec = Spec::from_args(&args)?;
    let mut session = Session::open(&spec).await?;
    if args.via_outbox {
        anyhow::ensure!(
            args.format == Format::Json,
            "--via-outbox writes JSON outbox rows: it takes --format json only"
        );
        session = session.via_outbox(&spec.database_url).await?;
    }
    let plain =
        args.envelope == produce::shape::Envelope::Plain && args.ids == produce::shape::Ids::Uuid;
    anyhow::ensure!(
        plain || (args.format == Format::Json && !args.via_outbox),
        "--envelope cloudevents and --ids stripe write JSON records straight to the topic: not \
         with --via-outbox (the relay sets its own event ids) or a registry --format (its \
         schemas take UUID event ids)"
    );
    let registry = args.schema_registry.as_deref();
    session = session
        .in_format(args.format, registry, &spec.topic)
        .await?
        .shaped(args.ids, args.envelope);
    if let Some(w) = &session.wire {
        eprintln!(
            "loadgen: {} payments, schema id {} (subject {}-value at {})",
            w.format().name(),
            w.schema_id(),
            spec.topic,
            registry.unwrap_or_default()
        );
    }
    let produced = produce_stage(&session, &spec).await?;
    let (report, via_outbox) = finish(&session, &spec, &produced).await?;
    println!("{}", report::summary_table(&report));
    if let Some(v) = &via_outbox {
        println!("{}", v.summary());
    }
    println!(
        "report: {} and {}",
        spec.report_dir.join("report.json").display(),
        spec.report_dir.join("report.html").display()
    );
    Ok(report.verified)
}
