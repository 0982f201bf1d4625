//! The import-only `sgl_kernel` stand-in the SGLang engines run with is never called: SGLang's CPU
//! engine without AMX falls back to torch's own kernels, and the stand-in's functions only record
//! that they were called and raise (scripts/real-engines/sglang-stand-in/sgl_kernel/__init__.py).

use std::sync::Arc;

use anyhow::{ensure, Context};
use kvgate_real_engines::fleet::{stand_in_call_log, Fleet, Runtime};

pub async fn no_sgl_kernel_stand_in_function_was_called(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    ensure!(!fleet.of(Runtime::Sglang).is_empty(), "no SGLang engine in this fleet");
    let calls = stand_in_call_log(fleet.run_dir());
    let imported = calls.with_extension("log.imported");
    let importers = std::fs::read_to_string(&imported)
        .with_context(|| format!("the stand-in was never imported ({} is missing)", imported.display()))?;
    ensure!(importers.lines().count() > 0, "the stand-in's import marker {} is empty", imported.display());
    if let Ok(log) = std::fs::read_to_string(&calls) {
        anyhow::bail!("SGLang called the sgl_kernel stand-in; the calls ({}):\n{log}", calls.display());
    }
    eprintln!("    sgl_kernel stand-in imported by {} SGLang processes, called by none", importers.lines().count());
    Ok(())
}
