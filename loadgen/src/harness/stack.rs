//! The single-node stack's services crashed and restarted through `scripts/stack.sh`, for the
//! harnesses that do it (`loadgen chaos`'s outages, `loadgen soak`), with the check that the
//! script's stack is the one the run uses before anything is crashed.

use std::process::Stdio;

/// Makes sure `scripts/stack.sh` (with the `STACK_DIR` this process inherited) manages the
/// Kafka and PostgreSQL of `services`, before a harness crashes one of them: a run against
/// another stack must not crash the default one under `.stack/`.
pub(crate) async fn check_stack(services: &crate::Services) -> anyhow::Result<()> {
    let out = tokio::process::Command::new("scripts/stack.sh")
        .arg("env")
        .stderr(Stdio::null())
        .output()
        .await?;
    let env = String::from_utf8_lossy(&out.stdout);
    let var = |name: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("export {name}=")))
            .map(str::to_string)
    };
    let dir = std::env::var("STACK_DIR").unwrap_or_else(|_| ".stack".into());
    anyhow::ensure!(
        out.status.success()
            && var("KAFKA_BROKERS").as_deref() == Some(services.brokers.as_str())
            && var("DATABASE_URL").as_deref() == Some(services.database_url.as_str()),
        "this harness crashes and restarts services with scripts/stack.sh, whose stack \
         (STACK_DIR={dir}) is not the one this run uses (KAFKA_BROKERS={}): set STACK_DIR to \
         the stack's folder and source its env file",
        services.brokers
    );
    Ok(())
}

/// `scripts/stack.sh <cmd>` (`pg-crash`, `kafka-crash`, `up`), failing if the script does.
pub(crate) async fn stack(cmd: &str) -> anyhow::Result<()> {
    let status = tokio::process::Command::new("scripts/stack.sh")
        .arg(cmd)
        .stdout(Stdio::null())
        .status()
        .await?;
    anyhow::ensure!(status.success(), "scripts/stack.sh {cmd} failed");
    Ok(())
}
