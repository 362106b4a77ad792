//! `granule status`: the nodes of a running cluster as a table (like `kubectl get`).

use anyhow::Context;
use granule_controller::ControllerClient;

pub fn run(controller: &str) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let nodes = rt
        .block_on(async {
            let c = ControllerClient::connect_tool(controller, "granule status").await?;
            c.list_nodes().await
        })
        .with_context(|| format!("asking the controller at {controller}"))?;
    print!("{}", granule_report::usage::node_table(&nodes));
    println!();
    print!("{}", granule_report::usage::proclet_table(&nodes));
    Ok(())
}
